"""Session 7 bisect of the CUDA compile test's wrong gradients (every family, torch 2.11 + inductor + bf16 autocast).
Prints, per variant, the relative gradient error of the compiled blocks against eager (same settings) and of both
against an fp32 eager reference, so the run says which side is wrong and which setting makes it go away."""
import copy
import sys

import torch

sys.path.insert(0, ".")
import torch.nn.functional as F

import models
from models import mlp, norms
from training import compile_blocks

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TINY = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "vocab_size": 256, "max_position_embeddings": 1024}
MIXERS = {"transformer": {"mixer": "attention"},
          "mamba2": {"mixer": "mamba2", "mixer_kwargs": {"head_dim": 32, "state_size": 16}}}


def loss_grads(model, ids, amp):
    model.zero_grad(set_to_none=True)
    with torch.autocast(DEV, dtype=torch.bfloat16, enabled=amp):
        loss = model(input_ids=ids, labels=ids, return_logits=False).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def summary(g, ref):
    r = {n: rel(g[n], ref[n]) for n in ref}
    worst = sorted(r, key=r.get, reverse=True)[:5]
    return f"worst {', '.join(f'{n[6:]} {r[n]:.3f}' for n in worst)}; embed {r['model.embed_tokens.weight']:.3f} " \
           f"norm0 {r['model.layers.0.mixer_norm.weight']:.3f} normf {r.get('model.norm.weight', float('nan')):.3f}"


class _Plain:
    """Stands in for an autograd.Function: its math through autograd (the plain formula)."""

    def __init__(self, fn):
        self.apply = fn


def _rms(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def _gated(x, g, w, eps, before, gs):
    xf, gf = x.float(), g.float()
    u = xf if before else xf * F.silu(gf)
    ug = u.unflatten(-1, (-1, gs))
    y = (ug * torch.rsqrt(ug.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2) * w.float()
    return (y * F.silu(gf) if before else y).to(x.dtype)


def _swiglu(gate, up, w):
    return F.linear(F.silu(gate) * up, w)


PLAIN = {"rms": (norms, "_RMSNormFn", _rms), "gated": (norms, "_GatedRMSNormFn", _gated),
         "swiglu": (mlp, "_SwiGLUDownFn", _swiglu)}
ORIGINAL = {k: getattr(m, n) for k, (m, n, _) in PLAIN.items()}


def case(family, backend, amp, nested=True, calls=3, seq=256, plain=()):
    for key, (mod, name, fn) in PLAIN.items():
        setattr(mod, name, _Plain(fn) if key in plain else ORIGINAL[key])
    torch.manual_seed(0)
    eager = models.build_model({**TINY, **MIXERS[family]}).to(DEV)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, backend=backend)
    if not nested:
        for m in compiled.modules():
            if hasattr(m.forward, "tracing_config"):
                m.forward.tracing_config = torch._dynamo.config.patch(nested_graph_breaks=False)
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(5)).to(DEV)
    _, g32 = loss_grads(eager, ids, False)
    le, ge = loss_grads(eager, ids, amp)
    out = []
    for i in range(calls):
        lc, gc = loss_grads(compiled, ids, amp)
        out.append(f"call{i + 1}: loss {lc:.5f} vs eager {le:.5f}; vs eager: {summary(gc, ge)}; vs fp32: {summary(gc, g32)}")
    print(f"== {family} backend={backend} amp={amp} nested={nested} plain={plain}  eager-amp vs fp32: {summary(ge, g32)}")
    for line in out:
        print("   ", line)
    sys.stdout.flush()


if __name__ == "__main__":
    print(torch.__version__)
    for fam in ("transformer", "mamba2"):
        for plain in [(), ("rms",), ("swiglu",), ("rms", "gated", "swiglu")]:
            try:
                case(fam, "aot_eager", False, calls=1, plain=plain)
            except Exception as e:  # noqa: BLE001
                print(f"== {fam} plain={plain}: {type(e).__name__}: {str(e)[:300]}")
