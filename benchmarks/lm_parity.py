"""Language-model quality against peers: hilo's model and a peer implementation trained side by side on the same
token stream from the same initial weights.

    python benchmarks/lm_parity.py                                   # GDN vs fla, Transformer vs Llama, Mamba-2, 125m
    python benchmarks/lm_parity.py --families gated_deltanet --size 340m --steps 600 --seeds 0,1,2

Pairs (benchmarks/peer_models.py):
  gated_deltanet  hilo's Gated DeltaNet      vs fla's GatedDeltaNetForCausalLM (flash-linear-attention, CUDA)
  transformer     hilo's Transformer         vs transformers' LlamaForCausalLM (SDPA attention)
  mamba2          hilo's Mamba-2, model.mlp=false  vs transformers' Mamba2ForCausalLM (mamba_ssm's kernels when
                  installed, else its PyTorch path)
  loglinear_mamba2  hilo's log-linear Mamba-2 (with MLPs, 15 levels: max_position_embeddings = 16384) vs fla's
                  LogLinearMamba2ForCausalLM (CUDA)
  gated_deltanet_qwen3_next  hilo's Gated DeltaNet  vs transformers' Qwen3NextForCausalLM with every layer linear
                  attention (Qwen3NextGatedDeltaNet) and a dense MLP, on its own PyTorch delta rule: a GDN peer
                  independent of fla, for machines where fla's kernels refuse (its backward on Hopper with Triton
                  >= 3.4, < 3.7.1); slower than hilo by its PyTorch chunk loop

For each family and seed, the hilo model is built from conf/model/<family>.yaml and conf/model/size/<size>.yaml
(model.max_position_embeddings = --seq-len; 16384 for loglinear_mamba2) under torch.manual_seed(seed); the peer is
built with the same sizes and hilo's initial weights copied in, so the two start equal and differ only in their
implementations. Both train on the same batches (the embedded corpus through hilo's loader, fixed packing, drawn
once) with the same recipe: AdamW (betas 0.9 / 0.95, weight decay 0.1 on matrices other than the embedding), linear
warmup over the first 10% of steps then cosine to 10% of --lr, global grad-norm clipping at 1.0, bf16 autocast, and
one loss function (fp32 next-token cross-entropy of the logits). Reported per run: the training loss over the last
10% of steps, the held-out loss (32 rows of --seq-len tokens from the corpus' held-out file) at the end, tokens/s
over the steps after the first 10, and the peak GPU memory of its training (both models stay resident: each run's
peak holds the other model's weights too, the same amount on both sides). The seeds give the noise floor: hilo
matches its peer when |hilo - peer| at one seed is within the spread between seeds. Needs CUDA for fla's kernels
(the other pairs also run on CPU).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
# run as a script, this folder is sys.path[0]: the repository's packages are imported from REPO, ahead of the rest
sys.path.insert(0, str(REPO))

PEERS = {"gated_deltanet": "fla GatedDeltaNetForCausalLM", "transformer": "transformers LlamaForCausalLM",
         "mamba2": "transformers Mamba2ForCausalLM", "loglinear_mamba2": "fla LogLinearMamba2ForCausalLM",
         "gated_deltanet_qwen3_next": "transformers Qwen3NextForCausalLM (linear attention, PyTorch path)"}
# the hilo family of each pair (the pair's name where they are the same)
HILO_FAMILY = {"gated_deltanet_qwen3_next": "gated_deltanet"}


# overrides that make hilo's model the peer's architecture (Mamba2ForCausalLM's blocks have no MLP)
FAMILY_OVERRIDES = {"mamba2": ["model.mlp=false"]}
# fla's LogLinearMamba2 fixes 15 levels, hilo's max_position_embeddings = 16384 (otherwise the training length)
FAMILY_MAX_POSITIONS = {"loglinear_mamba2": 16384}


def compose(family: str, size: str, seq_len: int):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return hydra_compose(config_name="train", overrides=[
            f"model={family}", f"model/size={size}",
            f"model.max_position_embeddings={FAMILY_MAX_POSITIONS.get(family, seq_len)}",
            f"trainer.seq_len={seq_len}", "logger=none", *FAMILY_OVERRIDES.get(family, [])])


def token_stream(cfg, seq_len: int, batch_size: int, steps: int, val_rows: int):
    """(steps batches [batch_size, seq_len + 1] of token ids, held-out rows [val_rows, seq_len + 1], vocab size)."""
    from omegaconf import OmegaConf

    from data import build_train_loader, load_tokenizer
    from training.validation import heldout_rows

    tokenizer = load_tokenizer(OmegaConf.to_container(cfg.tokenizer, resolve=True))
    data_cfg = {**OmegaConf.to_container(cfg.data, resolve=True), "prefetch": 0}
    loader = build_train_loader(data_cfg, tokenizer, seq_len=seq_len + 1, batch_size=batch_size, seed=0)
    batches = []
    for batch in loader:
        batches.append(batch["input_ids"].clone())
        if len(batches) == steps:
            break
    val = heldout_rows(data_cfg, tokenizer, seq_len + 1, val_rows)
    return batches, val, tokenizer


def build_pair(cfg, family: str, seed: int, tokenizer, device: str):
    import models
    from benchmarks import peer_models
    from training.config import model_kwargs

    torch.manual_seed(seed)
    hilo = models.build_model(model_kwargs(cfg.model, tokenizer.vocab_size, tokenizer)).to(device)
    builders = {"gated_deltanet": peer_models.fla_gated_deltanet_model, "transformer": peer_models.llama_model,
                "mamba2": peer_models.mamba2_model, "loglinear_mamba2": peer_models.fla_loglinear_mamba2_model,
                "gated_deltanet_qwen3_next": peer_models.qwen3_next_gated_deltanet_model}
    return hilo, builders[family](hilo)


def lr_at(step: int, steps: int, lr: float) -> float:
    warmup = max(1, steps // 10)
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def next_token_loss(model, rows: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=rows[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(model, val: torch.Tensor, batch_size: int, device: str, autocast) -> float:
    model.eval()
    total = 0.0
    for i in range(0, len(val), batch_size):
        rows = val[i:i + batch_size].to(device)
        with autocast():
            total += float(next_token_loss(model, rows)) * len(rows)
    model.train()
    return total / len(val)


def train(model, batches, val, lr: float, device: str) -> dict:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=device == "cuda")
    cuda = device == "cuda"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)

    model.train()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses, steps, warm = [], len(batches), min(10, len(batches) - 1)
    start = None
    for step, rows in enumerate(batches):
        if step == warm:
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        with autocast():
            loss = next_token_loss(model, rows.to(device, non_blocking=True))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    losses = torch.stack(losses).float().cpu()
    tail = max(1, steps // 10)
    tokens = (steps - warm) * batches[0].shape[0] * (batches[0].shape[1] - 1)
    return {"train_loss_tail": float(losses[-tail:].mean()), "train_loss_curve": losses[::max(1, steps // 20)].tolist(),
            "val_loss": heldout_loss(model, val, batches[0].shape[0], device, autocast),
            "tokens_per_s": tokens / elapsed, "peak_mem_gib": peak_gib,
            "nonfinite": int((~torch.isfinite(losses)).sum())}


def table(results: list[dict]) -> str:
    lines = ["| family | implementation | seed | train loss (last 10%) | held-out loss | tokens/s | peak GiB |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['family']} | {r['impl']} | {r['seed']} | {r['status']} | - | - | - |")
            continue
        peak = f"{r['peak_mem_gib']:.2f}" if r.get("peak_mem_gib") is not None else "-"
        lines.append(f"| {r['family']} | {r['impl']} | {r['seed']} | {r['train_loss_tail']:.4f} | "
                     f"{r['val_loss']:.4f} | {r['tokens_per_s']:,.0f} | {peak} |")
    lines.append("")
    lines.append("| family | mean abs(hilo - peer) held-out | spread between seeds (hilo) | spread between seeds (peer) |")
    lines.append("|---|---|---|---|")
    for family in dict.fromkeys(r["family"] for r in results):
        rows = [r for r in results if r["family"] == family]
        if any(r["status"] != "ok" for r in rows):
            lines.append(f"| {family} | (a run failed) | - | - |")
            continue
        by = {(r["impl"], r["seed"]): r["val_loss"] for r in rows}
        seeds = sorted({r["seed"] for r in rows})
        diff = sum(abs(by[("hilo", s)] - by[("peer", s)]) for s in seeds) / len(seeds)
        spread = {impl: max(by[(impl, s)] for s in seeds) - min(by[(impl, s)] for s in seeds) for impl in ("hilo", "peer")}
        lines.append(f"| {family} | {diff:.4f} | {spread['hilo']:.4f} | {spread['peer']:.4f} |")
    return "\n".join(lines)


def train_or_refusal(impl: str, model, batches, val, lr: float, device: str) -> dict:
    """train()'s results with status "ok"; for a peer that raises (fla's Triton-version checks raise RuntimeError,
    a kernel that does not compile on this Triton raises its CompilationError), status "failed: <first line> ... <last line>"
    instead, so the other rows still run. hilo's own failures propagate."""
    try:
        return {"status": "ok", **train(model, batches, val, lr, device)}
    except Exception as err:  # third-party code: any failure is the peer's row
        if impl == "hilo":
            raise
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        # the first line says where; Triton's CompilationError gives the reason on its last
        said = lines[:1] + lines[-1:] if len(lines) > 1 else lines
        return {"status": f"failed: {type(err).__name__}" + (f": {' ... '.join(said)}" if said else "")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default="gated_deltanet,transformer,mamba2",
                    help=f"comma-separated, from {sorted(PEERS)}")
    ap.add_argument("--size", default="125m", help="conf/model/size preset")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--out", type=Path, default=None, help="write results.json and table.md here")
    args = ap.parse_args(argv)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in PEERS]
    if unknown:
        ap.error(f"unknown families {unknown}; choose from {sorted(PEERS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    if len(seeds) < 2:
        ap.error("--seeds needs at least two seeds: their spread is the noise floor the comparison is read against")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    batches = val = None
    for family in families:
        cfg = compose(HILO_FAMILY.get(family, family), args.size, args.seq_len)
        if batches is None:
            batches, val, tokenizer = token_stream(cfg, args.seq_len, args.batch_size, args.steps, 32)
        for seed in seeds:
            hilo, peer = build_pair(cfg, family, seed, tokenizer, device)
            for impl, model in (("hilo", hilo), ("peer", peer)):
                row = {"family": family, "impl": impl, "peer": PEERS[family], "seed": seed, "size": args.size,
                       "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps, "lr": args.lr}
                row.update(train_or_refusal(impl, model, batches, val, args.lr, device))
                print(json.dumps({k: v for k, v in row.items() if k != "train_loss_curve"}), flush=True)
                results.append(row)
            del hilo, peer
            if device == "cuda":
                torch.cuda.empty_cache()
    text = table(results)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "table.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
