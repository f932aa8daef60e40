"""Where a training step's GPU time goes: CUDA time per kernel of a few forward + backward + optimizer steps.

    python benchmarks/step_profile.py --families mamba2 gated_deltanet --seq-len 8192     # 340m, 32K tokens/step
    python benchmarks/step_profile.py --families transformer --size tiny --seq-len 256 --device cpu   # quick check
    python benchmarks/step_profile.py --families mamba2 --compile       # the blocks compiled, as trainer.compile=true

Each family (conf/model/<family>.yaml at preset --size, random weights, seed 0) trains on random tokens as train.py
does on a GPU: fp32 master weights, bf16 autocast, fused AdamW, the model's own loss. Two untimed steps compile
the kernels, then --steps steps run under torch.profiler. Printed per family: the kernels sorted by total device
time (ms per step, share of the step), the step time between synchronisations and the peak allocated memory. This
is the profile that explains a train_throughput.py row (docs/performance.md).
"""
import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# run as a script, this folder is sys.path[0]: the repository's packages are imported from REPO, ahead of the rest
sys.path.insert(0, str(REPO))

from benchmarks.decode import FAMILIES, build


def profile_family(family, size, seq_len, batch, steps, overrides, device, top, compile_blocks=False):
    import torch
    from torch.profiler import ProfilerActivity, profile

    model, config = build(family, size, seq_len, overrides, None, device, torch.float32)
    model.train()
    if compile_blocks:  # as trainer.compile=true: the blocks' training forwards through torch.compile
        from training.compile import compile_blocks as compile_model_blocks

        compile_model_blocks(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (batch, seq_len + 1), generator=gen).to(device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        with autocast:
            loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(2):
        step()
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    step_ms = 1e3 * (time.perf_counter() - start) / steps
    key = "device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, key, 0) > 0]
    if device.type == "cuda":  # kernels only (no CPU-side op rows, which double count their kernels)
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: getattr(e, key), reverse=True)
    total = sum(getattr(e, key) for e in events) / 1e3 / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    print(f"\n### {family} {size} T={seq_len} B={batch}{' compiled' if compile_blocks else ''}: {step_ms:.1f} ms/step "
          f"(profiled), kernels {total:.1f} ms/step, "
          f"peak {peak:.1f} GiB")
    print("| kernel | calls/step | ms/step | share |\n|---|---|---|---|")
    for e in events[:top]:
        ms = getattr(e, key) / 1e3 / steps
        print(f"| {e.key[:90]} | {e.count // steps} | {ms:.2f} | {100 * ms / total:.1f}% |")
    model = opt = None  # free them for empty_cache (not `del`: step() closes over them, F821)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None):
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=["mamba2"], choices=FAMILIES)
    ap.add_argument("--size", default="340m")
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens per step (batch = tokens // seq_len)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="compile the blocks, as trainer.compile=true")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. ++model.fused_projections=true")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    for family in args.families:
        profile_family(family, args.size, args.seq_len, max(args.tokens // args.seq_len, 1), args.steps,
                       args.overrides, device, args.top, compile_blocks=args.compile)


if __name__ == "__main__":
    main()
