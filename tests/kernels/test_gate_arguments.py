"""The public operators' gates: g, beta and level_scales are keyword-only (a call in another library's order fails
instead of running on swapped values), and g must hold log decays (g <= 0), checked without a host read off the
CPU."""
import pytest
import torch

import hilo_kernels
from hilo_kernels.common import validate

B, T, H, D = 1, 6, 2, 4


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = {n: torch.randn(B, T, H, D, generator=gen) for n in ("q", "k", "v")}
    x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    x["beta"] = torch.rand(B, T, H, generator=gen)
    x["g"] = -0.3 * torch.rand(B, T, H, generator=gen)
    x["level_scales"] = torch.rand(B, T, H, 4, generator=gen) + 0.5
    return x


GATES = {"linear_attn": ("g",), "hla2": ("g",), "ahla": ("g",), "hla3": ("g",), "delta_rule": ("beta", "g"),
         "loglinear_attn": ("g", "level_scales"), "loglinear_delta_rule": ("beta", "g", "level_scales")}


def _call(op, x, **overrides):
    gates = {n: overrides.get(n, x[n]) for n in GATES[op]}
    return getattr(hilo_kernels, op)(x["q"], x["k"], x["v"], **gates, backend="torch")


@pytest.mark.parametrize("op", sorted(GATES))
def test_gates_by_position_fail_with_the_keyword_form(op):
    x = _inputs()
    _call(op, x)  # by keyword: runs
    with pytest.raises(TypeError, match=rf"{op}\(q, k, v, {', '.join(f'{n}={n}' for n in GATES[op])}"):
        getattr(hilo_kernels, op)(x["q"], x["k"], x["v"], *(x[n] for n in GATES[op]), backend="torch")


def test_delta_rule_in_fla_order_fails():
    """fla's chunk_gated_delta_rule(q, k, v, g, beta): the same positional call on hilo's op is refused."""
    x = _inputs()
    with pytest.raises(TypeError, match="keyword-only"):
        hilo_kernels.delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"])


@pytest.mark.parametrize("op", sorted(GATES))
def test_positive_g_is_refused_naming_g_and_the_fix(op):
    x = _inputs()
    g = x["g"].clone()
    g[0, 3, 1] = 0.2  # one positive entry: decays passed as exp(g), or a sign error
    with pytest.raises(ValueError, match=r"g must hold log decays") as err:
        _call(op, x, g=g)
    assert op in str(err.value) and "softplus" in str(err.value) and "logsigmoid" in str(err.value)
    _call(op, x, g=torch.zeros_like(g))  # g == 0 (no decay) is a log decay
    out, _ = _call(op, x, g=torch.full_like(g, float("nan")))  # NaN is the non-finite guard's, not refused here
    assert out.isnan().any()


def test_the_device_check_is_an_assertion_on_the_device(monkeypatch):
    """Off the CPU the check is torch._assert_async on the reduced condition: nothing is read on the host (a meta
    tensor, whose values cannot be read, goes through it)."""
    seen = []
    monkeypatch.setattr(torch, "_assert_async", lambda cond, msg: seen.append((cond.device.type, msg)))
    validate.check_log_decays("linear_attn", torch.empty(B, T, H, device="meta"))
    assert seen and seen[0][0] == "meta" and "g must hold log decays" in seen[0][1]
