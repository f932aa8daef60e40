"""Helpers shared by the recurrent operator families (linear_attn, delta_rule, ...): input validation,
cu_seqlens -> chunk tables, and the SPEC §2 error ratio. Imports torch only."""

from .metrics import error_ratio
from .precision import autocast_off
from .validate import check_recurrent_inputs, resolve_backend
from .varlen import chunk_table, sequence_bounds

__all__ = ["autocast_off", "check_recurrent_inputs", "chunk_table", "error_ratio", "resolve_backend", "sequence_bounds"]
