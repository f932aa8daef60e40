"""Helpers shared by the recurrent operator families (linear_attn, delta_rule, ...): input validation,
cu_seqlens -> chunk tables, the bf16 error ratio (docs/kernels.md), and the Triton kernels' launch settings with
their one override (launch_settings, docs/kernel_settings.md). Imports torch only."""

from .launch import launch_settings
from .metrics import error_ratio
from .precision import autocast_off
from .validate import check_recurrent_inputs, resolve_backend
from .varlen import chunk_table, sequence_bounds

__all__ = ["autocast_off", "check_recurrent_inputs", "chunk_table", "error_ratio", "launch_settings", "resolve_backend", "sequence_bounds"]
