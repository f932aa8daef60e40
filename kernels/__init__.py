"""hilo kernels: one package per operator family (docs/kernels.md).

Each family exposes one public function that validates its inputs and picks a backend.
"""

from kernels.delta_rule import delta_rule
from kernels.hla import ahla, hla2, hla3
from kernels.linear_attn import linear_attn
from kernels.loglinear_attn import loglinear_attn
from kernels.loglinear_delta_rule import loglinear_delta_rule
from kernels.short_conv import short_conv
from kernels.softmax_attn import softmax_attn

__all__ = ["ahla", "delta_rule", "hla2", "hla3", "linear_attn", "loglinear_attn", "loglinear_delta_rule",
           "short_conv", "softmax_attn"]
