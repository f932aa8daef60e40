"""Session 11: which kernel faults (illegal address) in loglinear_delta_rule at Gated DeltaNet 340m's heads
(B = 2, T = 16384, H = 3, K = 256, V = 512, bf16) under HILO_LOGLINEAR=scan_cols=64,scan_levels=4 (s11_a.sh), and
whether the stacked tile's width (16 columns) or one stacked level per program is the trigger. Run once per variant in
a fresh process with CUDA_LAUNCH_BLOCKING=1 (the fault kills the context): prints the stage reached and the
launch that faulted."""
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch

from kernels import loglinear_delta_rule
from kernels.loglinear_attn import num_levels
from kernels.loglinear_delta_rule import triton_bwd as tb
from kernels.loglinear_delta_rule import triton_fwd

DEV = "cuda" if torch.cuda.is_available() else "cpu"
b, t, h, dk, dv = 2, int(os.environ.get("T", "16384")), 3, 256, 512
gen = torch.Generator(device=DEV).manual_seed(0)
q = torch.randn(b, t, h, dk, device=DEV, generator=gen).bfloat16().requires_grad_()
k = torch.nn.functional.normalize(torch.randn(b, t, h, dk, device=DEV, generator=gen), dim=-1).bfloat16()
k.requires_grad_()
v = torch.randn(b, t, h, dv, device=DEV, generator=gen).bfloat16().requires_grad_()
beta = torch.rand(b, t, h, device=DEV, generator=gen).bfloat16().requires_grad_()
g = (-0.05 * torch.rand(b, t, h, device=DEV, generator=gen)).requires_grad_()
lam = (0.5 + torch.rand(b, t, h, num_levels(t), device=DEV, generator=gen)).requires_grad_()
lay_launches = triton_fwd.scan_launches


def show(lay, mode, count, dk_, dv_):
    out = lay_launches(lay, mode, count, dk_, dv_)
    print("  scan launches (j0, stacked, groups, BV):", out, flush=True)
    return out


triton_fwd.scan_launches = show
tb.scan_launches = show
try:
    o, st = loglinear_delta_rule(q, k, v, beta, g, lam, output_final_state=True, backend="triton")
    torch.cuda.synchronize() if DEV == "cuda" else None
    print("  forward ok", flush=True)
    (o.float().square().mean() + st.levels.square().mean()).backward()
    torch.cuda.synchronize() if DEV == "cuda" else None
    print("  backward ok", float(q.grad.float().norm()), flush=True)
except Exception as e:  # noqa: BLE001
    tb_lines = [ln for ln in traceback.format_exc().splitlines() if "kernels/" in ln or "Error" in ln]
    print("  FAILED:", type(e).__name__, *tb_lines[-4:], sep="\n    ", flush=True)
