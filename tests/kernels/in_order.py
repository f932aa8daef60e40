"""The public operators called with all their inputs in one positional tuple, the order the tests build them in.

The operators take g, beta and level_scales by keyword only (docs/kernels.md); these wrappers name them, so a test
can unpack (q, k, v, beta, g, ...) tuples into a call.
"""
from hilo_kernels import ahla, delta_rule, hla2, hla3, linear_attn, loglinear_attn, loglinear_delta_rule
from hilo_kernels.loglinear_attn import loglinear_attn_step
from hilo_kernels.loglinear_delta_rule import loglinear_delta_rule_step


def linear_attn_pos(q, k, v, g=None, **kwargs):
    return linear_attn(q, k, v, g=g, **kwargs)


def delta_rule_pos(q, k, v, beta, g=None, **kwargs):
    return delta_rule(q, k, v, beta=beta, g=g, **kwargs)


def loglinear_attn_pos(q, k, v, g, level_scales, **kwargs):
    return loglinear_attn(q, k, v, g=g, level_scales=level_scales, **kwargs)


def loglinear_delta_rule_pos(q, k, v, beta, g, level_scales, **kwargs):
    return loglinear_delta_rule(q, k, v, beta=beta, g=g, level_scales=level_scales, **kwargs)


def hla2_pos(q, k, v, g=None, **kwargs):
    return hla2(q, k, v, g=g, **kwargs)


def ahla_pos(q, k, v, g=None, **kwargs):
    return ahla(q, k, v, g=g, **kwargs)


def hla3_pos(q, k, v, g=None, **kwargs):
    return hla3(q, k, v, g=g, **kwargs)


def loglinear_attn_step_pos(q, k, v, g, level_scales, state, **kwargs):
    return loglinear_attn_step(q, k, v, g=g, level_scales=level_scales, state=state, **kwargs)


def loglinear_delta_rule_step_pos(q, k, v, beta, g, level_scales, state, **kwargs):
    return loglinear_delta_rule_step(q, k, v, beta=beta, g=g, level_scales=level_scales, state=state, **kwargs)
