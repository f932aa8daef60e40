"""Session 7: which of hilo's autograd.Functions gives wrong gradients inside a compiled graph on this machine.
Each module alone, compiled (aot_eager, then inductor) against eager, fp32, input an intermediate that needs grad."""
import sys

import torch

sys.path.insert(0, ".")
from models.mlp import SwiGLU
from models.norms import GatedRMSNorm, RMSNorm

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def grads(mod, fn, x0):
    mod.zero_grad(set_to_none=True)
    x = x0.clone().requires_grad_()
    out = fn(x * 1.5)  # the module's input is an intermediate, as in a block
    (out.float() * torch.linspace(-1, 1, out.numel(), device=DEV).view_as(out)).sum().backward()
    return {"x": x.grad, **{n: p.grad for n, p in mod.named_parameters()}}


def rel(a, b):
    if a is None or b is None:
        return f"{'None' if a is None else 'set'}/{'None' if b is None else 'set'}"
    return f"{((a - b).norm() / b.norm().clamp_min(1e-30)).item():.2e}"


torch.manual_seed(0)
x0 = torch.randn(2, 8, 64, device=DEV)
cases = {
    "RMSNorm": (RMSNorm(64).to(DEV), None),
    "GatedRMSNorm(after)": (GatedRMSNorm(64, group_size=32).to(DEV), "gate"),
    "GatedRMSNorm(before)": (GatedRMSNorm(64, norm_before_gate=True).to(DEV), "gate"),
    "SwiGLU": (SwiGLU(64, 96).to(DEV), None),
}
print(torch.__version__, DEV)
for backend in ("aot_eager", "inductor"):
    for name, (mod, kind) in cases.items():
        with torch.no_grad():
            for p in mod.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        if kind == "gate":
            g0 = torch.randn(2, 8, 64, device=DEV)
            fn = lambda x, m=mod, g=g0: m(x, g * 1.0)
        else:
            fn = mod
        torch._dynamo.reset()
        ref = grads(mod, fn, x0)
        got = grads(mod, torch.compile(fn, backend=backend, fullgraph=True), x0)
        print(f"{backend:9s} {name:22s}", {k: rel(got[k], ref[k]) for k in ref})
