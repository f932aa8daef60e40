"""Launch settings of the Triton kernels: one table of defaults per kernel family, the head-size rules that pick a
setting from the head size, and one way to override them for a benchmark (docs/kernel_settings.md).

The kernels read their family's settings at every launch (`current("delta_rule").state_warps`), so an override
applies to the launches made inside it:

    from hilo_kernels.common import launch_settings

    with launch_settings(delta_rule=dict(state_warps=8), linear_attn=dict(bwd_warps=8)):
        bench()                      # launches with the overrides
    bench()                          # launches with the defaults again

Triton compiles one binary per launch configuration, so overriding costs a compile per new setting and nothing
else. The overrides are process-wide (every thread sees them), changed and restored under a lock; nesting works, the
inner block's values winning inside it. A setting left at None follows its head-size rule (the functions below).
"""

import dataclasses
import threading
import typing
from contextlib import contextmanager
from typing import Any


@dataclasses.dataclass(frozen=True)
class DeltaRule:
    """hilo_kernels/delta_rule's Triton launches (warps per program, pipelining stages, tiles)."""

    prepare_warps: int = 4
    state_warps: int = 4  # the sequential forward state pass
    output_warps: int = 4
    intra_warps: int = 4
    state_bwd_warps: int = 8  # the sequential reverse state pass
    grads_warps: int = 4  # the fused chunk-parallel backward kernel
    grads_stages: int = 3
    grads_maxnreg: int | None = None  # a register cap a thread for the fused backward kernel (None: none)
    grads_kb: int = 32  # the fused backward kernel's K-block, and the V-blocks of its two passes over V
    grads_bv: int = 32
    grads_bv2: int = 32
    state_bv: int = 64  # V-block of the state passes while the (sequence, head) pairs fill the GPU
    state_bwd_bv: int = 64
    state_bv_min: int | None = None  # the smallest V-block they halve to (None: delta_rule_state_bv_floor's rule)
    wide_stages: int = 2  # pipelining stages of 16-bit state passes at K > 128 and V-blocks <= 32


@dataclasses.dataclass(frozen=True)
class LinearAttn:
    """hilo_kernels/linear_attn's Triton launches (hla's compositions run these kernels too)."""

    state_warps: int = 4  # the sequential state kernels, forward (_chunk_states_fwd) and backward (_chunk_dstates_bwd)
    state_stages: int = 3
    state_bk: int | None = None  # their [K, V] tile (None: linear_attn.triton_fwd.state_blocks' rule)
    state_bv: int | None = None
    state_segments: int | None = None  # segments a walk splits into (None: triton_fwd.segment_count's rule; 1: none)
    out_warps: int = 4  # the chunk-parallel output kernel _chunk_out_fwd
    out_stages: int = 2
    bwd_warps: int = 4  # the fused chunk-parallel backward _chunk_bwd_fused
    bwd_stages: int = 1
    bwd_maxnreg: int | None = None


@dataclasses.dataclass(frozen=True)
class LogLinearAttn:
    """hilo_kernels/loglinear_attn's node-form gradient kernels (hilo_kernels/loglinear_attn/triton_nodes.py)."""

    node_stages: int = 2  # software-pipelining stages of their per-level loops
    node_grads_split: bool | None = None  # two kernels (reads; writes) instead of one (None: the head-size rule)
    node_grads_warps: int | None = None  # their warps (None: the head-size rule)


@dataclasses.dataclass(frozen=True)
class LogLinearDeltaRule:
    """hilo_kernels/loglinear_delta_rule's level scans (hilo_kernels/loglinear_delta_rule/triton_fwd.py, triton_bwd.py)."""

    scan_cols: int | None = None  # stacked-column budget of the forward scans (None: loglinear_delta_scan_cols)
    bwd_scan_cols: int | None = None  # that of the backward scans (None: the forward's)
    scan_warps: int | None = None  # warps a level-scan program (None: 8, or 16 past 16K values a stacked tile)
    scan_levels: int = 8  # most chunk levels one level-scan program carries (a power of two)
    pieces16: bool | None = None  # 16-bit inputs: the scans read scaled fp16 pieces (None: loglinear_delta_pieces16)
    bwd_scan_stages: int | None = None  # pipelining stages of the backward scans (None: loglinear_delta_bwd_stages)


@dataclasses.dataclass(frozen=True)
class ShortConv:
    """hilo_kernels/short_conv's Triton launches: [block_t tokens, block_c channels] tiles and warps a program."""

    block_t: int = 64  # without an initial state (training)
    block_c: int = 64
    warps: int = 4
    state_block_t: int = 32  # with one (decoding's prefill)
    state_block_c: int = 64
    state_warps: int = 4
    silu_in_graph: bool | None = None  # SiLU as torch ops after the op (None: while torch.compile traces the call)


@dataclasses.dataclass(frozen=True)
class HLA:
    """hilo_kernels/hla's fused kernels (hilo_kernels/hla/triton_fused.py), per kernel family: the sequential state scans, the
    chunk outputs (_chunk_out), the value gradients (_pass_dvalues), the query / key gradients (_pass_dqk)."""

    scan_warps: int = 4
    scan_stages: int = 2
    scan_maxnreg: int | None = None
    scan_by: int | None = None  # the scans' state columns (None: 64, halved to 32 on small grids)
    out_warps: int = 4
    out_stages: int = 2
    out_maxnreg: int | None = None
    out_bk: int = 128  # the K loop's block
    out_by: int | None = None  # output columns (None: hla_cols' rule)
    dvalues_warps: int = 4
    dvalues_stages: int = 2
    dvalues_maxnreg: int | None = None
    dvalues_bk: int = 128
    dvalues_bv: int | None = None  # output columns (None: hla_cols' rule)
    dqk_warps: int = 4
    dqk_stages: int = 2
    dqk_maxnreg: int | None = None
    dqk_bk: int = 64
    dqk_bv: int | None = None  # the V loop's block (None: 32, even at V = 16)


FAMILIES: dict[str, type] = {"delta_rule": DeltaRule, "linear_attn": LinearAttn, "loglinear_attn": LogLinearAttn,
                             "loglinear_delta_rule": LogLinearDeltaRule, "short_conv": ShortConv,
                             "hla": HLA}

_lock = threading.Lock()
_current: dict[str, Any] = {name: cls() for name, cls in FAMILIES.items()}


def defaults(family: str):
    """The shipped launch settings of `family`."""
    return _family_class(family)()


def current(family: str):
    """The launch settings `family`'s kernels launch with now (the defaults unless overridden)."""
    _family_class(family)
    return _current[family]


def _family_class(family: str) -> type:
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {sorted(FAMILIES)}")
    return FAMILIES[family]


def check_settings(**families: dict) -> None:
    """Raise the ValueError launch_settings would for these overrides (an unknown family or setting, a value of the
    wrong type), without applying them."""
    for family, fields in families.items():
        _check(family, dict(fields))


def _check(family: str, fields: dict) -> None:
    known = {f.name: f for f in dataclasses.fields(_family_class(family))}
    for name, value in fields.items():
        if name not in known:
            raise ValueError(f"{family}: unknown launch setting {name!r}; expected one of {sorted(known)}")
        kinds = typing.get_args(known[name].type) or (known[name].type,)  # int | None -> (int, NoneType)
        if type(value) not in kinds:  # exact: a bool is no int here
            default = getattr(defaults(family), name)
            raise ValueError(f"{family}: {name}={value!r}: expected {known[name].type} (default {default!r})")


@contextmanager
def launch_settings(**families: dict):
    """Override launch settings inside a `with` block, per family: launch_settings(delta_rule=dict(state_warps=8)).
    An unknown family or setting, or a value of the wrong type, is a ValueError naming the valid ones; on leaving the
    block the settings are what they were before it."""
    check_settings(**families)
    with _lock:
        saved = {family: _current[family] for family in families}
        for family, fields in families.items():
            _current[family] = dataclasses.replace(_current[family], **fields)
    try:
        yield
    finally:
        with _lock:
            _current.update(saved)


# ---------------------------------------------------------------------------------------------- head-size rules


def delta_rule_state_bv_floor(dk: int) -> int:
    """Smallest V-block delta_rule's state passes halve to on small grids: state_bv_min where set (16 at the least,
    the smallest tl.dot width), else 16 up to K = 128 and 32 past it (docs/kernel_settings.md)."""
    chosen = current("delta_rule").state_bv_min
    return max(16, chosen) if chosen else (16 if dk <= 128 else 32)


def loglinear_attn_grads_split(bk: int, bv: int) -> tuple[bool, int]:
    """(split, warps) of loglinear_attn's node-form gradient kernels for [bk, bv] tiles: the node_grads_split /
    node_grads_warps settings where set, else split at 4 warps for heads up to K = 128, V = 64 and one kernel at 8
    warps otherwise (docs/kernel_settings.md)."""
    launch = current("loglinear_attn")
    small = bk <= 128 and bv <= 64
    split = small if launch.node_grads_split is None else launch.node_grads_split
    return split, launch.node_grads_warps or (4 if small else 8)


def loglinear_delta_scan_cols(dk: int) -> int:
    """The forward level scans' stacked-column budget: the scan_cols setting where set, else 256 (64 stacked columns
    of V) at K > 128 and 128 up to it (docs/kernel_settings.md)."""
    chosen = current("loglinear_delta_rule").scan_cols
    return chosen if chosen else (256 if dk > 128 else 128)


def loglinear_delta_bwd_scan_cols(dk: int) -> int:
    """The backward level scans' budget: the bwd_scan_cols setting where set, else the forward's."""
    return current("loglinear_delta_rule").bwd_scan_cols or loglinear_delta_scan_cols(dk)


def loglinear_delta_pieces16(dk: int, in_dtype) -> bool:
    """Whether the level scans read scaled fp16 pieces: never for fp32 inputs (their products are exact); else the
    pieces16 setting where set, else at K > 128 (docs/kernel_settings.md)."""
    import torch

    if in_dtype == torch.float32:
        return False
    chosen = current("loglinear_delta_rule").pieces16
    return dk > 128 if chosen is None else chosen


def loglinear_delta_bwd_stages(dk: int, in_dtype) -> int:
    """Pipelining stages of the backward level scans: the bwd_scan_stages setting where set, else 2 where the pieces
    are fp16 at K > 128 and 1 otherwise (docs/kernel_settings.md)."""
    chosen = current("loglinear_delta_rule").bwd_scan_stages
    if chosen:
        return chosen
    return 2 if dk > 128 and loglinear_delta_pieces16(dk, in_dtype) else 1


class HLACols(typing.NamedTuple):
    out_by: int
    dvalues_bv: int


def hla_cols(dk: int) -> HLACols:
    """The output columns of hla's chunk kernels (_chunk_out's out_by, _pass_dvalues' dvalues_bv) for a pass of key
    width dk: the settings where set, else 64, or 32 at K > 128 (docs/kernel_settings.md)."""
    launch = current("hla")
    wide = 32 if dk > 128 else 64
    return HLACols(launch.out_by or wide, launch.dvalues_bv or wide)
