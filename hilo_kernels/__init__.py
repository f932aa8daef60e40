"""hilo kernels: one package per operator family (docs/kernels.md).

Each family exposes one public function that validates its inputs and picks a backend.
"""

from hilo_kernels.delta_rule import delta_rule
from hilo_kernels.hla import ahla, hla2, hla3
from hilo_kernels.linear_attn import linear_attn
from hilo_kernels.loglinear_attn import loglinear_attn
from hilo_kernels.loglinear_delta_rule import loglinear_delta_rule
from hilo_kernels.short_conv import short_conv
from hilo_kernels.softmax_attn import softmax_attn

__all__ = ["ahla", "delta_rule", "hla2", "hla3", "linear_attn", "loglinear_attn", "loglinear_delta_rule",
           "short_conv", "softmax_attn"]
