"""Session 13: which delta_rule kernel hits the illegal memory access of test_triton_fp16_paths[opts2] on the H200
(lowp_bwd, prepare_mode=1, two-kernel backward; fp16, K = 32, V = 32 zero-padded to 64, varlen, initial state).
Every case runs in its own process under CUDA_LAUNCH_BLOCKING=1 (the fault is sticky), prints the phase that
failed and the last kernel frame of the traceback, and checks the fp32 oracle's error ratio where it ran."""
import os
import subprocess
import sys

CASES = [  # (HILO_DELTA_RULE, dtype, K, V)
    ("prepare_mode=1,fused_bwd=0", "float16", 32, 32),
    ("prepare_mode=1,fused_bwd=1", "float16", 32, 32),
    ("prepare_mode=2,fused_bwd=0", "float16", 32, 32),
    ("prepare_mode=2,fused_bwd=0,lowp_bwd=0", "float16", 32, 32),
    ("prepare_mode=1,fused_bwd=0", "bfloat16", 32, 64),
    ("prepare_mode=2,fused_bwd=0", "bfloat16", 32, 64),
    ("prepare_mode=2,fused_bwd=0", "bfloat16", 64, 64),
    ("prepare_mode=1,fused_bwd=0", "bfloat16", 128, 128),
    ("prepare_mode=2,fused_bwd=0", "bfloat16", 128, 128),
]

CHILD = r"""
import sys, traceback, torch
from kernels.delta_rule import delta_rule
dt, dk, dv = getattr(torch, sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
gen = torch.Generator().manual_seed(13)
t, h = 150, 2
q, k, v = (torch.randn(1, t, h, d, generator=gen) for d in (dk, dk, dv))
k = torch.nn.functional.normalize(k, dim=-1)
beta, g = torch.rand(1, t, h, generator=gen), -torch.rand(1, t, h, generator=gen) * 0.3
h0 = torch.randn(3, h, dk, dv, generator=gen)
cu = torch.tensor([0, 1, 16, 150])
x16 = [a.to(dt) for a in (q, k, v, beta)]
ref = [a.to(dt).float() for a in (q, k, v, beta)]
phase = "forward"
try:
    outs = {}
    for name, xs, be in (("triton", x16, "triton"), ("naive", ref, "naive")):
        leaves = [a.cuda().requires_grad_() for a in xs] + [g.cuda().requires_grad_(), h0.cuda().requires_grad_()]
        o, s = delta_rule(*leaves[:4], leaves[4], initial_state=leaves[5], output_final_state=True,
                          cu_seqlens=cu.cuda(), backend=be)
        torch.cuda.synchronize(); phase = "backward " + name
        grads = torch.autograd.grad(o.float().square().sum() + s.square().sum(), leaves)
        torch.cuda.synchronize(); phase = "forward"
        outs[name] = [o.float(), s] + [x.float() for x in grads]
    ratios = [((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()
              for a, b in zip(outs["triton"], outs["naive"])]
    print("ok  max error ratio %.2e" % max(ratios))
except Exception as e:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "kernels/" in f.filename]
    where = "; ".join(f"{f.filename.split('kernels/')[-1]}:{f.lineno} {f.line[:60]}" for f in frames[-2:])
    print(f"FAIL in {phase}: {type(e).__name__}: {str(e).splitlines()[0][:80]} | {where}")
"""

for opts, dt, dk, dv in CASES:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", HILO_DELTA_RULE=opts)
    try:
        r = subprocess.run([sys.executable, "-c", CHILD, dt, str(dk), str(dv)], env=env, capture_output=True,
                           text=True, timeout=120, check=False)
        line = (r.stdout.strip().splitlines() or [f"no output, rc={r.returncode}: {r.stderr.strip()[-200:]}"])[-1]
    except subprocess.TimeoutExpired:
        line = "timed out"
    print(f"| {opts:40s} | {dt:8s} | K={dk:3d} V={dv:3d} | {line}", flush=True)
