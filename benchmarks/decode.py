"""Decoding: per-token latency and decoding-state memory against context length, for every model family.

    python benchmarks/decode.py                                    # 340m on CUDA (bf16), every family, 1K..32K
    python benchmarks/decode.py --size tiny --contexts 256 1024 --families mamba2 transformer   # quick run
    python benchmarks/decode.py --families gated_deltanet model.mixer_kwargs.head_dim=128      # Hydra overrides

For each family (conf/model/<family>.yaml at preset --size, random weights, model.max_position_embeddings set to
the longest context plus the decoded tokens) and each context length L: a random prompt of L tokens is prefilled
through the model's forward with a fresh HiloCache (timed on its own, after one untimed prefill of the same
shape so kernel compilation is not counted), then warm-up + steps greedy tokens are decoded one at a time through
the path generate() takes (forward on the last token with the cache, logits_to_keep=1, argmax). Reported: the
median per-token latency of the timed steps (each step synchronised and timed on the host clock, so launch
overhead counts, as it does for a user; with --rounds N, default 2, the decode steps of every context are timed N
times, round after round over all contexts, and the row keeps the lowest median and shows the largest / smallest,
because batch-1 decoding is host-bound and one slow spell can otherwise land on one context), its ratio to the
shortest context's, the decoding state the cache holds
afterwards (HiloCache.state_bytes(): the sum of its tensors) next to models.cache.expected_state_bytes (the
state's arithmetic for L + decoded tokens), and the storage the cache actually keeps alive (HiloCache.held_bytes(): larger
when a state is a view into a bigger tensor), and on CUDA the peak allocated memory of the timed prefill and decode
(weights included). Once per family, at the shortest context, model.generate(...,
do_sample=False) must reproduce the manual loop's tokens; with --time-generate, generate()'s own per-token time
(its Python and host-sync overhead included) is reported next to the loop's.

Targets (H200, bf16; docs/performance.md): per-token latency at 32K within 1.1x of 1K for the linear families (mamba2,
gated_deltanet, hla_*), within 1.5x for log-linear; the Transformer's grows with its KV cache. On CUDA the model
runs in bf16; on CPU in fp32 (tests, smoke runs), where the default contexts are shorter.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# run as a script, this folder is sys.path[0]: the repository's packages are imported from REPO, ahead of the rest
sys.path.insert(0, str(REPO))

FAMILIES = ("transformer", "mamba2", "gated_deltanet", "loglinear_mamba2", "loglinear_gated_deltanet",
            "hla_transformer", "ahla_transformer", "hla3_transformer", "hla_mamba2", "hla_gated_deltanet")
# Bound on (per-token latency at the longest context) / (at the shortest); None: grows with the context.
LATENCY_TARGETS = {"transformer": None, "loglinear_mamba2": 1.5, "loglinear_gated_deltanet": 1.5}
DEFAULT_LATENCY_TARGET = 1.1
GPU_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
CPU_CONTEXTS = (256, 512, 1024, 2048)


def parse_with_overrides(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """ap.parse_args(argv) with every key=value word taken as a Hydra override (args.overrides) wherever it stands:
    after an option with nargs="+" (--families, --models, --contexts) argparse would take it as one more value."""
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    args = ap.parse_args([a for a in argv if a not in overrides])
    args.overrides = [*args.overrides, *overrides]
    return args


def latency_target(family: str) -> float | None:
    return LATENCY_TARGETS.get(family, DEFAULT_LATENCY_TARGET)


def unknown_sizes(sizes: list[str]) -> str | None:
    """None if every preset has a conf/model/size/<name>.yaml, else the message naming the unknown ones and the
    choices (a missing preset would otherwise surface as Hydra's config-search dump)."""
    bad = [s for s in sizes if not (REPO / "conf" / "model" / "size" / f"{s}.yaml").is_file()]
    if not bad:
        return None
    known = sorted(p.stem for p in (REPO / "conf" / "model" / "size").glob("*.yaml"))
    return f"unknown size(s) {bad}: presets are conf/model/size/<name>.yaml: {' '.join(known)}"


def build(family: str, size: str, max_positions: int, overrides: list[str], vocab_size: int | None, device, dtype):
    """(model in eval mode on device/dtype, its HiloConfig) from conf/train.yaml with model=family, model/size=size,
    random weights (seed 0). vocab_size None: the tokenizer config's vocab_size (8192 for the default)."""
    if (message := unknown_sizes([size])) is not None:
        raise ValueError(message)
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import models

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"model={family}", f"model/size={size}",
                                                      f"model.max_position_embeddings={max_positions}", *overrides])
    kwargs = OmegaConf.to_container(cfg.model, resolve=True)
    if vocab_size is None:
        vocab_size = cfg.data.get("vocab_size") or cfg.tokenizer.get("vocab_size")
        if vocab_size is None:
            raise ValueError("the tokenizer config has no vocab_size: pass --vocab-size")
    kwargs["vocab_size"] = int(vocab_size)
    torch.manual_seed(0)
    model = models.build_model(kwargs).to(device=device, dtype=dtype).eval()
    return model, model.config


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_timer(device, times: list[float]):
    """A timer for decode_steps: runs a step between device synchronisations and appends its seconds to times."""

    def timer(step) -> None:
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)

    return timer


def prefill(model, prompt):
    """Run the prompt through the model's forward with a fresh HiloCache; (cache, first greedy token [B, 1])."""
    from models import HiloCache

    cache = HiloCache.from_config(model.config)
    out = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
    return cache, out.logits[:, -1].argmax(-1, keepdim=True)


def decode_steps(model, cache, token, steps: int, timer=None):
    """Greedy-decode `steps` tokens one at a time from `token` (the last prompt token's prediction), as generate()
    does: forward on the newest token with the cache, logits_to_keep=1, argmax. timer(step_fn) may time each step.
    Returns the tokens [B, 1 + steps] (token first)."""
    import torch

    tokens = [token]

    def step():
        out = model(input_ids=tokens[-1], cache=cache, use_cache=True, logits_to_keep=1)
        tokens.append(out.logits[:, -1].argmax(-1, keepdim=True))

    for _ in range(steps):
        if timer is None:
            step()
        else:
            timer(step)
    return torch.cat(tokens, dim=1)


def generate_matches(model, prompt, reference, new_tokens: int) -> bool:
    """Whether model.generate(prompt, max_new_tokens=new_tokens, do_sample=False) produces reference's first
    new_tokens tokens (reference: the manual loop's prefill prediction followed by its decoded tokens)."""
    import torch

    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
    return torch.equal(out[:, prompt.shape[1]:], reference[:, :new_tokens])


def generate_ms_per_token(model, prompt, steps: int, device, repeats: int = 5) -> float:
    """Per-token milliseconds of model.generate itself (greedy): the time of generating 1 + steps tokens minus that
    of generating 1 (both include the same prefill), over steps. HF's per-step overhead (logits processors,
    stopping criteria, their host syncs) is in it. Each time is the fastest of `repeats` interleaved runs: one run
    each made a difference of two noisy timings, negative on a busy 2-core CI machine."""
    import torch

    def timed(new_tokens: int) -> float:
        _sync(device)
        start = time.perf_counter()
        model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        _sync(device)
        return time.perf_counter() - start

    timed(2)  # warm-up
    long, short = [], []
    for _ in range(repeats):
        long.append(timed(1 + steps))
        short.append(timed(1))
    return 1e3 * (min(long) - min(short)) / steps


def _retimed_median(model, prompt, decoded: int, warmup: int, device) -> float:
    """A later round's per-token median (seconds) at one context: prefill again, decode as the first round did."""
    cache, token = prefill(model, prompt)
    times: list[float] = []
    decode_steps(model, cache, token, decoded, _host_timer(device, times))
    return statistics.median(times[warmup:])


def measure_family(family: str, size: str, contexts: list[int], steps: int, warmup: int, batch: int,
                   verify_tokens: int, overrides: list[str], vocab_size: int | None, device, dtype,
                   time_generate: bool = False, compile_mode: str | None = None, rounds: int = 1) -> list[dict]:
    """One row per context length for one family (see the module docstring); compile_mode: decode with
    model.compile_decoding(mode) ("default" for torch.compile's default mode), None eagerly. rounds > 1 times the
    decode steps again at every context, round after round over all contexts (so a slow spell of the host or the
    device does not land on one context only); a row's ms/token is the lowest of its rounds' medians."""
    import torch

    from models.cache import expected_state_bytes

    contexts = sorted(contexts)
    decoded = warmup + steps
    model, config = build(family, size, contexts[-1] + max(decoded, verify_tokens) + 1, overrides, vocab_size,
                          device, dtype)
    if compile_mode is not None:
        torch._dynamo.reset()
        model.compile_decoding(mode=None if compile_mode == "default" else compile_mode)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(0)
    rows, prompts = [], []
    with torch.no_grad():
        for i, length in enumerate(contexts):
            prompt = torch.randint(0, config.vocab_size, (batch, length), generator=gen).to(device)
            prompts.append(prompt)
            warm = prefill(model, prompt)  # untimed: compiles / autotunes the prefill kernels for this shape
            del warm
            _sync(device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            cache, token = prefill(model, prompt)
            _sync(device)
            prefill_s = time.perf_counter() - start
            held_after_prefill = cache.held_bytes()
            times: list[float] = []
            tokens = decode_steps(model, cache, token, decoded, _host_timer(device, times))
            seen, state, held = cache.get_seq_length(), cache.state_bytes(), cache.held_bytes()
            # peak allocated memory of the timed prefill and decode (weights included), before the checks below
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            generate_ok = None
            if i == 0 and verify_tokens > 0:
                if verify_tokens > tokens.shape[1]:  # decode the rest (after the state was measured)
                    more = decode_steps(model, cache, tokens[:, -1:], verify_tokens - tokens.shape[1])
                    tokens = torch.cat([tokens, more[:, 1:]], dim=1)
                generate_ok = generate_matches(model, prompt, tokens, verify_tokens)
            del cache
            gen_ms = generate_ms_per_token(model, prompt, steps, device) if time_generate else None
            rows.append({
                "family": family, "size": size, "params": params, "context": length, "batch": batch,
                "dtype": str(dtype).removeprefix("torch."), "prefill_ms": 1e3 * prefill_s,
                "round_ms": [1e3 * statistics.median(times[warmup:])], "steps": steps, "warmup": warmup,
                "tokens_seen": seen, "state_bytes": state,
                "expected_bytes": expected_state_bytes(config, seen, batch, dtype),
                "held_bytes": held, "held_after_prefill_bytes": held_after_prefill,
                "peak_mem_gib": peak,
                "generate_matches": generate_ok,
                "generate_ms_per_token": gen_ms,
            })
        for _ in range(rounds - 1):
            for row, prompt in zip(rows, prompts, strict=True):
                row["round_ms"].append(1e3 * _retimed_median(model, prompt, decoded, warmup, device))
    for row in rows:  # rows[0] first, so its ms_per_token is set before the ratios use it
        row["ms_per_token"] = min(row["round_ms"])
        row["round_spread"] = max(row["round_ms"]) / min(row["round_ms"])
        row["latency_ratio"] = row["ms_per_token"] / rows[0]["ms_per_token"]
    return rows


NOISY_SPREAD = 1.2  # rounds whose medians differ by more than this make a family's verdict line say so


def _rounds(row: dict) -> str:
    """How many rounds timed the row and how far apart their medians were (largest / smallest)."""
    n = len(row["round_ms"])
    return "1" if n == 1 else f"{n}, x{row['round_spread']:.2f}"


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


def _bounded_verdict(first: dict, last: dict, bound: float) -> str:
    """The latency verdict of a family with a bound: the ratio of the fastest rounds at the longest and shortest
    contexts against it, and "unsettled" where the rounds' own spread reaches across the bound (the ratio would fall
    on the other side of it with the slowest round at one end), as batch-1 decoding is host-bound: on the H200 hla3_transformer
    read x1.17 from 1K rounds x1.16 apart, then x0.98 in three rounds."""
    ratio = last["latency_ratio"]
    low = ratio / first["round_spread"]  # the slowest shortest-context round
    high = ratio * last["round_spread"]  # the slowest longest-context round
    if low <= bound < high:
        return (f"latency x{ratio:.2f} (x{low:.2f} to x{high:.2f} across the rounds): the x{bound} target is "
                "unsettled, re-run with more --rounds")
    return f"latency x{ratio:.2f}, {'meets' if ratio <= bound else 'MISSES'} the x{bound} target"


def table(rows: list[dict]) -> str:
    """Markdown table of measure_family rows, then one verdict line per family (latency target and state memory)."""
    lines = [("| family | size | context | prefill ms | ms/token | rounds | x shortest | state MiB | expected MiB "
              "| held MiB | held after prefill MiB | peak GiB | generate() ms/token | generate() tokens |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = f"{r['peak_mem_gib']:.2f}" if r["peak_mem_gib"] is not None else "n/a"
        gen = {None: "", True: "same tokens", False: "DIFFERS"}[r["generate_matches"]]
        gen_ms = f"{r['generate_ms_per_token']:.3f}" if r.get("generate_ms_per_token") is not None else "n/a"
        lines.append(f"| {r['family']} | {r['size']} | {r['context']} | {r['prefill_ms']:.1f} | "
                     f"{r['ms_per_token']:.3f} | {_rounds(r)} | {r['latency_ratio']:.2f} | {_mib(r['state_bytes'])} | "
                     f"{_mib(r['expected_bytes'])} | {_mib(r['held_bytes'])} | {_mib(r['held_after_prefill_bytes'])} "
                     f"| {peak} | {gen_ms} | {gen} |")
    lines.append("")
    for family in dict.fromkeys(r["family"] for r in rows):
        fam = [r for r in rows if r["family"] == family]
        first, last = fam[0], fam[-1]
        bound = latency_target(family)
        if bound is None:
            verdict = f"latency x{last['latency_ratio']:.2f} (no bound: grows with the KV cache)"
        else:
            verdict = _bounded_verdict(first, last, bound)
        mem = "state = expected at every context" if all(r["state_bytes"] == r["expected_bytes"] for r in fam) \
            else "STATE DIFFERS FROM expected_state_bytes"
        spread = max(r["round_spread"] for r in fam)
        noisy = (f"; its rounds differ by up to x{spread:.2f}, so its latencies are noisy" if spread > NOISY_SPREAD
                 else "")
        lines.append(f"- {family}: context {first['context']} -> {last['context']}: {verdict}; {mem}{noisy}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--size", default=None, help="model/size preset (default: 340m on CUDA, tiny on CPU)")
    ap.add_argument("--contexts", nargs="+", type=int, default=None,
                    help=f"context lengths (default: {' '.join(map(str, GPU_CONTEXTS))} on CUDA, "
                         f"{' '.join(map(str, CPU_CONTEXTS))} on CPU)")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per context")
    ap.add_argument("--warmup", type=int, default=8, help="untimed decode steps before them")
    ap.add_argument("--rounds", type=int, default=2,
                    help="time every context this many times, round after round over all contexts; a row keeps "
                         "the lowest median and shows the spread (largest / smallest)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--verify-tokens", type=int, default=8,
                    help="tokens that model.generate must reproduce at the shortest context (0: skip the check)")
    ap.add_argument("--time-generate", action="store_true",
                    help="also time model.generate itself per token (two more prefills per context)")
    ap.add_argument("--compile-decoding", nargs="?", const="default", default=None, metavar="MODE",
                    help="decode with model.compile_decoding (torch.compile of the single-token steps; MODE is "
                         "torch.compile's, e.g. reduce-overhead for CUDA graphs; the warm-up steps absorb the "
                         "compilation)")
    ap.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer config's (8192)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                    help="model dtype (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every model (model.key=value), anywhere "
                                                 "on the command line")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_with_overrides(ap, argv)
    if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.rounds < 1:
        ap.error("--steps, --batch and --rounds must be >= 1 and --warmup >= 0")

    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = device.type == "cuda"
    dtype = getattr(torch, args.dtype or ("bfloat16" if on_gpu else "float32"))
    size = args.size or ("340m" if on_gpu else "tiny")
    contexts = args.contexts or list(GPU_CONTEXTS if on_gpu else CPU_CONTEXTS)
    if min(contexts) < 1:
        ap.error("context lengths must be >= 1")
    if (message := unknown_sizes([size])) is not None:
        ap.error(message)
    rows = []
    for family in args.families:
        rows += measure_family(family, size, contexts, args.steps, args.warmup, args.batch, args.verify_tokens,
                               args.overrides, args.vocab_size, device, dtype, args.time_generate,
                               args.compile_decoding, args.rounds)
        print(f"{family}: done", file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
