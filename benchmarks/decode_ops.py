"""Operators per decoding step: how many aten ops (each a kernel launch on a GPU, views excluded) one cached
single-token forward dispatches, per family. Eager decoding at batch 1 is bound by their host-side cost (Python,
dispatcher, launch), not by the GPU, so this count explains benchmarks/decode.py's per-token latency.

    python benchmarks/decode_ops.py                              # 340m, every family, CPU (the count is the same)
    python benchmarks/decode_ops.py --size tiny --families mamba2
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.decode import FAMILIES, build, prefill

# aten ops that only make views or metadata (no kernel launch)
VIEW_OPS = ("aten::view", "aten::_unsafe_view", "aten::t", "aten::transpose", "aten::unsqueeze", "aten::squeeze",
            "aten::expand", "aten::permute", "aten::slice", "aten::select", "aten::as_strided", "aten::alias",
            "aten::detach", "aten::split", "aten::unbind", "aten::reshape", "aten::_reshape_alias",
            "aten::unflatten", "aten::lift_fresh", "aten::chunk", "aten::narrow", "aten::promote_types",
            "aten::result_type", "aten::is_nonzero", "aten::sym_size", "aten::size", "aten::stride", "aten::dim")


def count_step_ops(model, prompt_len: int = 16) -> collections.Counter:
    """aten op counts (views excluded) of one cached decoding step after a prefill of prompt_len tokens."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.counts = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if not name.startswith(VIEW_OPS):
                self.counts[name] += 1
            return func(*args, **(kwargs or {}))

    prompt = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache, tok = prefill(model, prompt)
        model(input_ids=tok, cache=cache, use_cache=True, logits_to_keep=1)  # the first step may set up the cache
        with Count() as mode:
            model(input_ids=tok, cache=cache, use_cache=True, logits_to_keep=1)
    return mode.counts


def main(argv: list[str] | None = None) -> list[dict]:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--size", default="340m")
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args(argv)
    rows = []
    print("| family | size | ops per token | per layer | most frequent |")
    print("|---|---|---|---|---|")
    for family in args.families:
        model, cfg = build(family, args.size, 4096, [], None, torch.device("cpu"), torch.float32)
        counts = count_step_ops(model)
        total = sum(counts.values())
        top = ", ".join(f"{k.removeprefix('aten::')} {v}" for k, v in counts.most_common(args.top))
        rows.append({"family": family, "ops": total, "per_layer": total / cfg.num_layers, "counts": counts})
        print(f"| {family} | {args.size} | {total} | {total / cfg.num_layers:.1f} | {top} |", flush=True)
    return rows


if __name__ == "__main__":
    main()
