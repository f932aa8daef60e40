"""Session 10 diagnosis (GPU): do the short conv's new 64x64 tiles or torch.compile change Mamba-2 / GDN gradients at
training shapes? Session 9's compiled GDN 340m at 8K ended 10 steps at loss 7.09-7.10 (both value blocks), where
session 8's compiled runs had 6.69 and the eager runs 6.69-6.82; Mamba-2's compiled loss moved from 6.44 to 7.32 in
session 8. tests/training/test_compile.py -k cuda checks the same at the tiny preset (T = 256, 2 rows); this runs
the 340m widths (2 layers) at T = 8192: each variant's loss and its gradients' relative errors against fp32 eager,
beside eager bf16's own. Prints one table per family.

    python benchmarks/gpu_sessions/s10_diag_grads.py [--seq-len 8192] [--families mamba2 gated_deltanet]
"""
import argparse
import copy
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import models
from training import compile_blocks

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: a smoke run of the script only


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, return_logits=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--families", nargs="+", default=["mamba2", "gated_deltanet"])
    a = ap.parse_args()
    conv_pkg = sys.modules["kernels.short_conv"]  # `import kernels.short_conv` names the function the package exports
    conv_triton = importlib.import_module("kernels.short_conv.triton")
    default_tiles = conv_triton.TILES[False]
    # (name, short conv backend, tiles without a state, autocast bf16, compiled); reference: fp32 eager, ATen conv
    variants = [("fp32 triton 64x64", "triton", default_tiles, False, False),
                ("fp32 triton 32x64", "triton", (32, 64, 4), False, False),
                ("bf16 aten", "torch", default_tiles, True, False),
                ("bf16 triton 64x64", "triton", default_tiles, True, False),
                ("bf16 triton 32x64", "triton", (32, 64, 4), True, False),
                ("bf16 aten compiled", "torch", default_tiles, True, True),
                ("bf16 triton 64x64 compiled", "triton", default_tiles, True, True)]
    for family in a.families:
        torch.manual_seed(0)
        cfg = {"hidden_size": 1024, "num_layers": 2, "num_heads": 16, "vocab_size": 4096,
               "max_position_embeddings": a.seq_len, "mixer": family}
        base = models.build_model(cfg).to(DEV)
        ids = torch.randint(0, 4096, (a.batch, a.seq_len), generator=torch.Generator().manual_seed(5)).to(DEV)
        conv_pkg.CUDA_DEFAULT = "torch"
        ref_loss, ref = loss_and_grads(base, ids)
        rows = []
        for name, conv, tiles, bf16, compiled in variants:
            conv_pkg.CUDA_DEFAULT, conv_triton.TILES[False] = conv, tiles
            model = copy.deepcopy(base)
            torch._dynamo.reset()
            if compiled:
                compile_blocks(model, backend="inductor")
            with torch.autocast(DEV, dtype=torch.bfloat16, enabled=bf16):
                loss, grads = loss_and_grads(model, ids)
                if compiled:  # a second step: the steady compiled graph, as in training
                    loss, grads = loss_and_grads(model, ids)
            errs = sorted(((rel(g, ref[n]), n) for n, g in grads.items()), reverse=True)
            conv_errs = max(e for e, n in errs if "conv" in n)
            rows.append((name, loss, errs, conv_errs))
            del model
        conv_pkg.CUDA_DEFAULT, conv_triton.TILES[False] = "triton", default_tiles
        print(f"\n{family} 340m widths, 2 layers, T = {a.seq_len}, batch {a.batch}; reference: fp32 eager with ATen's "
              f"conv, loss {ref_loss:.5f}")
        print("| variant | loss | median grad err | worst conv grad err | worst three other than dt_bias, A_log |")
        print("|---|---|---|---|---|")
        for name, loss, errs, conv_err in rows:
            med = errs[len(errs) // 2][0]
            worst = "; ".join(f"{e:.3g} {n}" for e, n in [x for x in errs if "dt_bias" not in x[1]
                                                         and "A_log" not in x[1]][:3])
            print(f"| {name} | {loss:.5f} | {med:.3g} | {conv_err:.3g} | {worst} |")
        del base

if __name__ == "__main__":
    main()
