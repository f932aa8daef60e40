"""Every recurrent operator returns the same values and gradients inside a bf16 autocast region as outside it
(the model calls them from accelerate's autocast; their torch paths must not drop to bf16 math)."""
import pytest
import torch

from hilo_kernels import ahla, delta_rule, hla2, linear_attn, loglinear_attn, loglinear_delta_rule

B, T, H, D = 2, 70, 2, 16


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = {n: torch.randn(B, T, H, D, generator=gen) for n in ("q", "k", "v")}
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    x["g"] = -torch.rand(B, T, H, generator=gen) * 0.3
    x["beta"] = torch.rand(B, T, H, generator=gen)
    x["lam"] = torch.rand(B, T, H, 8, generator=gen) + 0.5
    return x


OPS = {
    "linear_attn": lambda x: linear_attn(x["q"], x["k"], x["v"], g=x["g"], backend="torch"),
    "delta_rule": lambda x: delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"], backend="torch"),
    "loglinear_attn": lambda x: loglinear_attn(x["q"], x["k"], x["v"], g=x["g"], level_scales=x["lam"],
                                               backend="torch"),
    "loglinear_delta_rule": lambda x: loglinear_delta_rule(x["q"], x["k"], x["v"], beta=x["beta"], g=x["g"],
                                                           level_scales=x["lam"], backend="torch"),
    "hla2": lambda x: hla2(x["q"], x["k"], x["v"], g=x["g"], backend="torch"),
    "ahla": lambda x: ahla(x["q"], x["k"], x["v"], g=x["g"], backend="torch"),
}


def _run(op, autocast):
    x = {n: t.clone().requires_grad_() for n, t in _inputs().items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        o = OPS[op](x)[0]
    o.square().sum().backward()
    return [o.detach()] + [x[n].grad for n in sorted(x) if x[n].grad is not None]


@pytest.mark.parametrize("op", sorted(OPS))
def test_same_result_under_autocast(op):
    ref, got = _run(op, False), _run(op, True)
    assert got[0].dtype == torch.float32
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
