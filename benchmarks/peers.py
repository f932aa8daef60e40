"""hilo's operators beside every installed peer, in one process on one GPU: a correctness cross-check, then times.

    python benchmarks/peers.py                                   # every op, T = 2K ... 32K at 32K tokens a call
    python benchmarks/peers.py --ops linear_attn delta_rule --seqlens 4096 16384

Peers (found if installed, never imported by hilo itself; the run lists the missing ones):
  linear_attn     fla's chunk_simple_gla (H = 16, K = V = 128); mamba_ssm's mamba_chunk_scan_combined at Mamba-2's
                  heads (48 heads, head dim 64, state 128, B and C shared by the heads)
  delta_rule      fla's chunk_gated_delta_rule
  loglinear_attn  fla's chunk_log_linear_attn; the log-linear attention paper's own kernel, hattention_kernel of
                  github.com/HanGuo97/log-linear-attention (package `hattention`, its Mamba-2 form)
  loglinear_delta_rule  hattention_kernel in its Gated DeltaNet form
  hla2            two passes of fla's chunk_simple_gla (K~ = LA(Q, K, K; 2g), o = LA(Q, K~, V; g))
  softmax_attn    torch's SDPA on its flash and cuDNN backends; flash-attn's flash_attn_func when installed
Each peer computes the same function as the hilo op on the same values (mamba_ssm takes x and dt with v = x * dt and
g = A * dt; A = -1 here, so dt = -g). For loglinear_delta_rule both sides L2-normalise q and k in the call: the
paper's kernel does it inside (hilo's Gated DeltaNet layers do it before the kernel). Correctness: hilo's GPU
backend and the peer on bf16 inputs, each against hilo's fp32 oracle (its "naive" or "torch" backend) on a small
odd-length batch: the output and the gradient of every input the two share, as error ratios (docs/kernels.md); a
peer is an independent oracle too, and a peer whose call fails (a version check, a dependency of another version) is
a row naming the error, at the check or at one length of the timing; one whose backward alone fails (fla 0.6's
gated backward on Hopper with Triton < 3.7.1) keeps its forward's check and times, the backward's cells naming the
error. Times: median ms of triton.testing.do_bench for
the forward and for forward + backward, at B * T = 32,768 tokens, and hilo's time over the fastest peer's. Each
row goes to stderr as it is measured (a run stopped by a time limit keeps those); the tables go to stdout at the end.

End to end (a training step of hilo's model beside the peer model with the same weights: tokens/s and peak memory)
is benchmarks/lm_parity.py, e.g. `python benchmarks/lm_parity.py --size 340m --seq-len 8192 --batch-size 4
--steps 40`.

On a GPU machine without network, wheels from the registry carry the peers: fla-core and flash-linear-attention
(pure Python), einops; mamba_ssm's Triton SSD code is pure Python too (its package builds CUDA extensions, so copy
its `mamba_ssm/ops/triton` directory or install with MAMBA_SKIP_CUDA_BUILD=TRUE). The log-linear paper's kernels
are pure Python + Triton: put the repository's root (the folder holding `hattention/`) on PYTHONPATH with
jaxtyping and einops. They need the fla of their own time (the commit their training submodule pins), so they run
in a second environment: docs/performance.md#carrying-the-peers-to-a-gpu-machine has the steps. """
from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# run as a script, this folder is sys.path[0]: the repository's packages are imported from REPO, ahead of the rest
sys.path.insert(0, str(REPO))

from hilo_kernels.common.checks import CASES
from hilo_kernels.common.metrics import error_ratio

SEQLENS = (2048, 4096, 8192, 16384, 32768)
TOKENS = 32768


@dataclass
class Shape:
    """Heads and head dims of one benchmark shape; grouped: q and k have one head shared by every value head."""
    label: str
    heads: int
    dim_k: int
    dim_v: int
    grouped: bool = False


H16 = Shape("H16 K128 V128", 16, 128, 128)
MAMBA2 = Shape("Mamba-2: H48 P64 N128, B/C shared", 48, 128, 64, grouped=True)


@dataclass
class Peer:
    """A peer of a hilo op: call(inputs) -> output [B, T, H, V] on the inputs in hilo's layout."""
    name: str
    op: str
    package: str | None  # the import that must succeed (None: always there)
    call: Callable[[dict], torch.Tensor]
    shapes: tuple[Shape, ...] = (H16,)


def installed(package: str | None) -> bool:
    return package is None or importlib.util.find_spec(package) is not None


# ---------------------------------------------------------------------------------------------------------------
# inputs and hilo's calls

def make_inputs(op: str, shape: Shape, b: int, t: int, device: str, seed: int = 0) -> dict:
    """fp32 inputs of op in hilo's layout ([B, T, H, D]; g [B, T, H] log decays; beta; level_scales)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    h, hk = shape.heads, 1 if shape.grouped else shape.heads
    if op == "softmax_attn":
        return {n: torch.randn(b, t, h, shape.dim_k, device=device, generator=gen) for n in ("q", "k", "v")}
    x = {"q": torch.randn(b, t, hk, shape.dim_k, device=device, generator=gen),
         "k": torch.randn(b, t, hk, shape.dim_k, device=device, generator=gen),
         "v": torch.randn(b, t, h, shape.dim_v, device=device, generator=gen),
         "g": -0.01 - 0.29 * torch.rand(b, t, h, device=device, generator=gen)}
    if op in ("delta_rule", "hla2"):  # the delta rule's keys; HLA's q and k, as its layers feed them (scale 1)
        x["k"] = torch.nn.functional.normalize(x["k"], dim=-1)
    if op == "hla2":
        x["q"] = torch.nn.functional.normalize(x["q"], dim=-1)
    if op in ("delta_rule", "loglinear_delta_rule"):
        x["beta"] = torch.rand(b, t, h, device=device, generator=gen).sigmoid()
    if op in ("loglinear_attn", "loglinear_delta_rule"):
        from hilo_kernels.loglinear_attn import num_levels

        x["level_scales"] = 0.5 + torch.rand(b, t, h, num_levels(t), device=device, generator=gen)
    return x


def hilo_call(op: str, backend: str) -> Callable[[dict], torch.Tensor]:
    """hilo's op on backend: the output only (no initial or final state); loglinear_delta_rule on L2-normalised q
    and k, the function its peer computes."""
    if op == "softmax_attn":
        from hilo_kernels import softmax_attn

        return lambda x: softmax_attn(x["q"], x["k"], x["v"], causal=True, backend=backend)
    call = CASES[op].call
    if op == "loglinear_delta_rule":
        from models.ops import l2_normalize

        return lambda x: call({**x, "q": l2_normalize(x["q"]), "k": l2_normalize(x["k"])}, None, backend)[0]
    return lambda x: call(x, None, backend)[0]


def oracle_backend(op: str) -> str:
    return "naive" if op == "softmax_attn" else CASES[op].oracle


def hilo_backend(op: str) -> str | None:
    """The backend hilo's layers use on a GPU (softmax_attn: its own pick, flash-attn or SDPA; hla2: its own pick,
    the two bf16 passes for bf16 inputs)."""
    return None if op in ("softmax_attn", "hla2") else CASES[op].backend


# ---------------------------------------------------------------------------------------------------------------
# the peers, each on hilo's inputs

def _fla_simple_gla(x):
    from fla.ops.simple_gla import chunk_simple_gla

    return chunk_simple_gla(x["q"], x["k"], x["v"], g=x["g"], scale=x["q"].shape[-1] ** -0.5)[0]


def _fla_hla2(x):
    """Second-order HLA as fla runs it: two chunk_simple_gla passes, K~ = LA(Q, K, K; 2g), o = LA(Q, K~, V; g)
    (hla2's default decay placement, "d1"; scale 1, on L2-normalised q and k as the HLA layers feed it)."""
    from fla.ops.simple_gla import chunk_simple_gla

    k_tilde = chunk_simple_gla(x["q"], x["k"], x["k"], g=2 * x["g"], scale=1.0)[0]
    return chunk_simple_gla(x["q"], k_tilde, x["v"], g=x["g"], scale=1.0)[0]


def _fla_gated_delta_rule(x):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"],
                                  scale=x["q"].shape[-1] ** -0.5)[0]


def _fla_log_linear_attn(x):
    from fla.ops.log_linear_attn import chunk_log_linear_attn

    return chunk_log_linear_attn(x["q"], x["k"], x["v"], g=x["g"], level_scales=x["level_scales"],
                                 scale=x["q"].shape[-1] ** -0.5)[0]


def _mamba_ssm_ssd(x):
    """SSD with A = -1: dt = -g, x_ssd = v / dt, so that x_ssd * dt = v and A * dt = g (C = q, B = k)."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    dt = -x["g"]
    a = -torch.ones(x["v"].shape[2], device=dt.device, dtype=torch.float32)
    y = mamba_chunk_scan_combined((x["v"] / dt.unsqueeze(-1)).to(x["v"].dtype), dt, a, x["k"], x["q"],
                                  chunk_size=256)
    return y * x["q"].shape[-1] ** -0.5  # hilo's linear_attn scales by K ** -0.5 (its default scale)


HATTENTION_CHUNK = 64  # hattention_kernel's chunk (its default chunk_sizes); it takes T in multiples of it only


def _levels_table(length, base, htype, dtype, device, default=-1, clamp_min=None, **_):
    """The [T, T] level of every (target t, source s) pair that hattention's chunk kernels read, in place of the
    repository's make_levels_matrix: bit_length(t XOR s) below the diagonal, 0 on it, `default` above, clamped below
    at clamp_min; the same table as the repository's HType.WEAK at base 2. The repository's own builder loads it from
    precomputed files on its authors' machines (or fills it pair by pair in Python), capped at T = 16,384."""
    if base != 2 or getattr(htype, "name", None) != "WEAK":
        raise NotImplementedError(f"peers.py builds hattention's level table for base 2 and HType.WEAK only, got "
                                  f"base {base} and {htype}")
    return _levels_cached(length, dtype, torch.device(device), default, clamp_min)


@functools.lru_cache(maxsize=2)
def _levels_cached(length: int, dtype: torch.dtype, device: torch.device, default: int, clamp_min: int | None):
    pos = torch.arange(length, device=device)
    table = torch.empty(length, length, dtype=dtype, device=device)
    for start in range(0, length, 1024):  # blocks of rows keep the temporaries small (the table is 8 GiB at 32K)
        rows = pos[start:start + 1024, None]
        xor = rows ^ pos
        bits = torch.zeros_like(xor)
        for shift in range(max(length - 1, 1).bit_length()):
            bits += (xor >> shift) > 0
        table[start:start + 1024] = torch.where(pos <= rows, bits, default)
    return table if clamp_min is None else table.clamp_(min=clamp_min)


def _hattention():
    """The log-linear repository's hattention.kernel and hattention.base, imported without running the package's
    __init__ (it registers the paper's HF models, which import causal_conv1d, a CUDA extension, and mamba_ssm; the
    kernels use neither), its chunk kernels reading the level table of _levels_table."""
    if "hattention" not in sys.modules:
        spec = importlib.util.find_spec("hattention")
        package = types.ModuleType("hattention")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["hattention"] = package
    kernel = importlib.import_module("hattention.kernel")
    for name in ("hattention.chunkwise", "hattention.chunkwise_hgdn"):
        importlib.import_module(name).make_levels_matrix = _levels_table
    return kernel, importlib.import_module("hattention.base")


def _pad_time(x: torch.Tensor, t: int) -> torch.Tensor:
    """x [B, T, ...] with zeros appended up to t steps (causal: later tokens change no earlier output)."""
    return x if x.shape[1] == t else torch.nn.functional.pad(x, (0, 0) * (x.ndim - 2) + (0, t - x.shape[1]))


def _hattention_kernel(x, delta: bool):
    """hattention_kernel on hilo's inputs, both in hilo's layout: q, k [B, T, H, K], v [B, T, H, V], g natural-log
    decays [B, T, H], l the level scales [B, T, H, L] indexed by the same level (bit_length(t XOR s)), head_first
    False, level base 2, HType.WEAK. It needs T in multiples of its chunk and the levels of that padded length, so
    both are padded with zeros. Mamba-2 form (hstruct MAMBA2): it takes no scale, so the output is multiplied by
    hilo's K ** -0.5. Gated DeltaNet form (GDELTA): b is beta; it L2-normalises q and k itself (the only mode it
    has) and multiplies q by scale. Neither form takes an initial state."""
    from hilo_kernels.loglinear_attn import num_levels

    kernel, base = _hattention()
    t, scale = x["q"].shape[1], x["q"].shape[-1] ** -0.5
    padded = -(-t // HATTENTION_CHUNK) * HATTENTION_CHUNK
    lam = x["level_scales"]
    extra = num_levels(padded) - lam.shape[-1]
    if extra > 0:  # levels no pair of the T real tokens reaches
        lam = torch.nn.functional.pad(lam, (0, extra))
    q, k, v, g, lam = (_pad_time(y, padded) for y in (x["q"], x["k"], x["v"], x["g"], lam))
    common = {"g": g, "l": lam, "head_first": False, "level_base": 2, "htype": base.HType.WEAK,
              "chunk_sizes": (HATTENTION_CHUNK, HATTENTION_CHUNK), "chunkwise": True}
    if delta:
        o = kernel.hattention_kernel(q, k, v, b=_pad_time(x["beta"], padded), scale=scale,
                                     hstruct=base.HStruct.GDELTA, use_qk_l2norm_in_kernel=True, **common)
    else:
        o = kernel.hattention_kernel(q, k, v, b=None, scale=None, hstruct=base.HStruct.MAMBA2, **common) * scale
    return o[:, :t]


def _sdpa(kind: str):
    def call(x):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[kind]
        q, k, v = (x[n].transpose(1, 2) for n in ("q", "k", "v"))
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    return call


def _flash_attn(x):
    from flash_attn import flash_attn_func

    return flash_attn_func(x["q"], x["k"], x["v"], causal=True)


PEERS = [
    Peer("fla chunk_simple_gla", "linear_attn", "fla", _fla_simple_gla),
    Peer("mamba_ssm mamba_chunk_scan_combined", "linear_attn", "mamba_ssm", _mamba_ssm_ssd, (MAMBA2,)),
    Peer("fla chunk_gated_delta_rule", "delta_rule", "fla", _fla_gated_delta_rule),
    Peer("fla chunk_log_linear_attn", "loglinear_attn", "fla", _fla_log_linear_attn),
    Peer("two fla chunk_simple_gla passes", "hla2", "fla", _fla_hla2),
    Peer("hattention hattention_kernel (Mamba-2)", "loglinear_attn", "hattention",
         functools.partial(_hattention_kernel, delta=False)),
    Peer("hattention hattention_kernel (Gated DeltaNet)", "loglinear_delta_rule", "hattention",
         functools.partial(_hattention_kernel, delta=True)),
    Peer("SDPA flash", "softmax_attn", None, _sdpa("flash")),
    Peer("SDPA cuDNN", "softmax_attn", None, _sdpa("cudnn")),
    Peer("flash-attn flash_attn_func", "softmax_attn", "flash_attn", _flash_attn),
]
OPS = tuple(dict.fromkeys(p.op for p in PEERS))


# ---------------------------------------------------------------------------------------------------------------
# correctness and timing

def leaves(inputs: dict, dtype: torch.dtype) -> dict:
    """Leaves requiring grad: activations in dtype, gates and level scales in fp32 (as the layers pass them)."""
    return {n: v.detach().to(torch.float32 if n in ("g", "level_scales") else dtype).requires_grad_()
            for n, v in inputs.items()}


def output_and_grads(call, inputs: dict, dtype: torch.dtype, seed: int = 11):
    x = leaves(inputs, dtype)
    o = call(x)
    return o.detach(), gradients(o, x, seed)


def gradients(o: torch.Tensor, x: dict, seed: int = 11) -> dict:
    """{input name: gradient of (o * do).sum()} for a seeded random do (None where o does not depend on it)."""
    do = torch.randn(o.shape, device=o.device, generator=torch.Generator(device=o.device).manual_seed(seed))
    grads = torch.autograd.grad((o.float() * do).sum(), list(x.values()), allow_unused=True)
    return dict(zip(x, grads))


def failure(err: BaseException) -> str:
    """A peer's failure in one line: its type and the first line of its message (some raise a bare ValueError)."""
    lines = str(err).strip().splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def cross_check(op: str, peer: Peer, shape: Shape, device: str, backend: str | None, b: int = 2, t: int = 777,
                dtype: torch.dtype = torch.bfloat16) -> dict:
    """Error ratios against hilo's fp32 oracle of hilo's backend and of the peer: {quantity: (hilo, peer)},
    or {"refused": message} when the peer's forward raises; when only its backward raises, the output's ratios and
    {"backward_refused": message} (fla 0.6 refuses its gated backward on some GPUs and Triton versions, and its
    forward still says something)."""
    inputs = make_inputs(op, shape, b, t, device)
    ro, rg = output_and_grads(hilo_call(op, oracle_backend(op)), inputs, torch.float32)
    ho, hg = output_and_grads(hilo_call(op, backend), inputs, dtype)
    x = leaves(inputs, dtype)
    try:
        po = peer.call(x)
    except Exception as err:  # noqa: BLE001 (any failure is the peer's row: third-party code, unpinned)
        return {"refused": failure(err)}
    errors = {"o": (error_ratio(ho, ro), error_ratio(po.detach(), ro))}
    try:
        pg = gradients(po, x)
    except Exception as err:  # noqa: BLE001 (as above)
        return {**errors, "backward_refused": failure(err)}
    for name, ref in rg.items():
        if ref is not None and hg.get(name) is not None and pg.get(name) is not None:
            errors[f"d{name}"] = (error_ratio(hg[name], ref), error_ratio(pg[name], ref))
    return errors


def median_ms(fn: Callable[[], object], device: str) -> float:
    if device == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return sorted(times)[1]


def timings(op: str, call, shape: Shape, t: int, device: str, tokens: int = TOKENS,
            backward: bool = True) -> tuple[float, float | None]:
    """(forward ms, forward + backward ms or None without backward) of call at B = tokens // t, bf16."""
    x = leaves(make_inputs(op, shape, max(tokens // t, 1), t, device), torch.bfloat16)
    with torch.no_grad():
        fwd = median_ms(lambda: call(x), device)
    if not backward:
        return fwd, None
    o = call(x)
    do = torch.randn_like(o)

    def fwd_bwd():
        torch.autograd.grad(call(x), list(x.values()), do, allow_unused=True)
    return fwd, median_ms(fwd_bwd, device)


def peer_timings(op: str, peer: Peer, shape: Shape, t: int, device: str, tokens: int = TOKENS) -> dict:
    """The peer's part of a timing row: peer_fwd and peer_fwd_bwd, or with a refused forward {"refused": message},
    or with a refused backward peer_fwd and {"backward_refused": message}."""
    try:
        fwd, _ = timings(op, peer.call, shape, t, device, tokens, backward=False)
    except Exception as err:  # noqa: BLE001 (a length the peer refuses is one row, not the end)
        return {"refused": failure(err)}
    try:
        _, fwd_bwd = timings(op, peer.call, shape, t, device, tokens)
    except Exception as err:  # noqa: BLE001 (as above)
        return {"peer_fwd": fwd, "backward_refused": failure(err)}
    return {"peer_fwd": fwd, "peer_fwd_bwd": fwd_bwd}


def run(ops, seqlens, device: str, peers=None, check_t: int = 777, tokens: int = TOKENS,
        backend: Callable[[str], str | None] = hilo_backend,
        report: Callable[[str], None] | None = None) -> tuple[list[dict], list[dict], list[str]]:
    """(correctness rows, timing rows, names of the missing peers); backend(op) is the hilo backend checked and
    timed (on a GPU, the one hilo's layers use). report, if given, gets each row as a table line once measured (a
    run stopped by a time limit keeps what it measured)."""
    peers = PEERS if peers is None else peers
    present = [p for p in peers if p.op in ops and installed(p.package)]
    missing = [f"{p.name} ({p.package})" for p in peers if p.op in ops and not installed(p.package)]
    checks, times = [], []
    for peer in present:
        for shape in peer.shapes:
            errors = cross_check(peer.op, peer, shape, device, backend(peer.op), t=check_t)
            checks.append({"op": peer.op, "peer": peer.name, "shape": shape.label, **errors})
            if report is not None:
                for line in check_lines(checks[-1]):
                    report(line)
            if "refused" in errors:
                continue
            for t in seqlens:
                hilo = timings(peer.op, hilo_call(peer.op, backend(peer.op)), shape, t, device, tokens)
                row = {"op": peer.op, "peer": peer.name, "shape": shape.label, "T": t, "hilo_fwd": hilo[0],
                       "hilo_fwd_bwd": hilo[1]}
                row.update(peer_timings(peer.op, peer, shape, t, device, tokens))
                times.append(row)
                if report is not None:
                    report(time_line(row))
    return checks, times, missing


def check_lines(row: dict) -> list[str]:
    """The correctness table's lines of one (op, peer, shape) row: one per quantity, or one naming the refusal (a
    refused backward: the output's line, then the refusal's)."""
    head = f"| {row['op']} | {row['peer']} | {row['shape']} |"
    if "refused" in row:
        return [f"{head} refused | {row['refused']} | - |"]
    lines = [f"{head} {quantity} | {value[0]:.2e} | {value[1]:.2e} |"
             for quantity, value in row.items() if isinstance(value, tuple)]
    if "backward_refused" in row:
        lines.append(f"{head} backward refused | {row['backward_refused']} | - |")
    return lines


def time_line(r: dict) -> str:
    """The timing table's line of one (op, peer, shape, T) row."""
    head = f"| {r['op']} | {r['peer']} | {r['shape']} | {r['T']} | {r['hilo_fwd']:.3f} |"
    if "refused" in r:
        return f"{head} refused: {r['refused']} | {r['hilo_fwd_bwd']:.3f} | - | - | - |"
    fwd = f"{r['peer_fwd']:.3f} | {r['hilo_fwd_bwd']:.3f} |"
    fwd_ratio = f"{r['hilo_fwd'] / r['peer_fwd']:.2f}x"
    if "backward_refused" in r:
        return f"{head} {fwd} backward refused: {r['backward_refused']} | {fwd_ratio} | - |"
    return f"{head} {fwd} {r['peer_fwd_bwd']:.3f} | {fwd_ratio} | {r['hilo_fwd_bwd'] / r['peer_fwd_bwd']:.2f}x |"


def tables(checks: list[dict], times: list[dict], missing: list[str]) -> str:
    lines = ["| op | peer | shape | quantity | hilo error | peer error |", "|---|---|---|---|---|---|"]
    for row in checks:
        lines += check_lines(row)
    lines += ["", ("| op | peer | shape | T | hilo fwd ms | peer fwd ms | hilo fwd+bwd ms | peer fwd+bwd ms | "
              "hilo / peer (fwd) | hilo / peer (fwd+bwd) |"), "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [time_line(r) for r in times]
    lines += ["", "Missing peers (not installed): " + (", ".join(missing) if missing else "none")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--seqlens", nargs="+", type=int, default=list(SEQLENS))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/peers.py needs a CUDA GPU (the peers' kernels are CUDA-only)", file=sys.stderr)
        return 2
    bad = [t for t in args.seqlens if t <= 0 or TOKENS % t]
    if bad:
        ap.error(f"--seqlens must divide {TOKENS} (tokens per call), got {bad}")
    checks, times, missing = run(args.ops, args.seqlens, "cuda",
                                 report=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(tables(checks, times, missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
