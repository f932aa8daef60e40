"""Where linear_attn's bf16 Triton forward loses accuracy, by emulation in float64 on CPU.

    python benchmarks/kernel_rounding.py [--seq-len 777 --heads 4 --dim 128]

The chunked forward of kernels/linear_attn/triton_fwd.py (chunk 64) in float64, rounding to bf16 exactly where the
kernels do: the inputs q, k, v; each chunk's entering state as stored (hs); the decayed keys of the state update;
the intra-chunk scores before their product with v (or, with split_scores, their two bf16 halves); the output.
fp32 accumulation is modelled as exact. Inputs are benchmarks/kernels.py's check inputs (the B = 2, T = 777 shape by
default); the error ratio (SPEC §2) of o is taken against the same computation with nothing rounded, for
linear_attn and for the HLA compositions hla2 ("d1") and ahla, whose passes also round their intermediate (K~,
V~). The table gives each rounding alone, everything, and everything but it; the GPU's own numbers for the same
check are in benchmarks/RESULTS.md (linear_attn o 3.73e-3, ahla's composition 5.00e-3, session 14), which the
"all" column reproduces (3.71e-3, 4.96e-3).

`--dg`: linear_attn's decay gradient in bf16 as its backward kernels round it, in the three forms hilo has used
(gate_grad_forms). At the check's shape it gives 1.52e-2 for one reverse sum over the document and 4.94e-3 for the
per-chunk value from the dstates pass, which the H200 measured at 1.76e-2 and 4.71e-3 (session 14), and 3.85e-3
for the committed form, computed in the chunk programs.
"""

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # as a script, benchmarks/ comes first and benchmarks/kernels.py would shadow kernels
    sys.path.insert(0, str(REPO))

from kernels.common import error_ratio

CHUNK = 64
ROUNDINGS = ("inputs", "states", "decayed_keys", "scores", "intermediate", "output")


def _bf16(x: torch.Tensor, on: bool) -> torch.Tensor:
    return x.bfloat16().double() if on else x


def _scores_times_v(scores, v, on: bool, split: bool):
    """The intra-chunk product as the kernel takes it: scores rounded to bf16, or as two bf16 halves."""
    hi = _bf16(scores, on)
    out = torch.einsum("bhij,bjhv->bihv", hi, v)
    if on and split:
        out = out + torch.einsum("bhij,bjhv->bihv", _bf16(scores - hi, True), v)
    return out


def entering_states(k, v, g, h0, round_states: bool, round_keys: bool):
    """The state entering each chunk as _chunk_states_fwd stores it (bf16 with round_states), and the final state;
    the decayed keys of each update rounded with round_keys. h0 [B, H, K, V] or None."""
    b, t, h, dk = k.shape
    state = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float64) if h0 is None else h0.clone()
    stored = []
    for c0 in range(0, t, CHUNK):
        sl = slice(c0, min(c0 + CHUNK, t))
        stored.append(_bf16(state, round_states))
        gc = g[:, sl].cumsum(1)  # [B, n, H]
        gl = gc[:, -1]  # [B, H]
        keys = _bf16(k[:, sl] * (gl[:, None] - gc).exp()[..., None], round_keys)
        state = state * gl.exp()[..., None, None] + torch.einsum("bthk,bthv->bhkv", keys, v[:, sl])
    return stored, state


def la_forward(q, k, v, g, h0, scale, rounds: set, split=False, out_key="output"):
    """One linear_attn pass (q, k, v, g float64 [B, T, H, *], h0 [B, H, K, V] or None) as the Triton forward computes
    it, rounding at the points named in `rounds`; out_key names the rounding its output takes."""
    t = q.shape[1]
    stored, _ = entering_states(k, v, g, h0, "states" in rounds, "decayed_keys" in rounds)
    o = torch.empty(*q.shape[:3], v.shape[-1], dtype=torch.float64)
    tril = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
    for c, c0 in enumerate(range(0, t, CHUNK)):
        sl = slice(c0, min(c0 + CHUNK, t))
        qc, kc, vc = q[:, sl], k[:, sl], v[:, sl]
        gc = g[:, sl].cumsum(1)
        n = qc.shape[1]
        acc = torch.einsum("bthk,bhkv->bthv", qc, stored[c]) * gc.exp()[..., None]
        gt = gc.transpose(1, 2)  # [B, H, n]
        decay = (gt[..., :, None] - gt[..., None, :]).clamp(max=0).exp()
        scores = torch.where(tril[:n, :n], torch.einsum("bihk,bjhk->bhij", qc, kc) * decay, 0.0)
        acc = acc + _scores_times_v(scores, vc, "scores" in rounds, split)
        o[:, sl] = _bf16(acc * scale, out_key in rounds)
    return o


def forward(op: str, x: dict, rounds: set, split=False) -> torch.Tensor:
    """o of linear_attn, hla2 or ahla on the check inputs x (float64 copies), with the given roundings."""
    q, k, v = (_bf16(x[n].double(), "inputs" in rounds) for n in ("q", "k", "v"))
    g = x["g"].double()
    d = q.shape[-1]
    if op == "linear_attn":
        return la_forward(q, k, v, g, x["initial_state"].double(), d ** -0.5, rounds, split)
    first, second = x["initial_state"].double().split(d, dim=-1)
    if op == "hla2":  # K~ = LA(Q, K, K; 2g), o = LA(Q, K~, V; g)
        mid = la_forward(q, k, k, 2 * g, first, 1.0, rounds, split, out_key="intermediate")
        return la_forward(q, mid, v, g, second, 1.0, rounds, split)
    mid = la_forward(q, k, v, g, first, 1.0, rounds, split, out_key="intermediate")  # ahla: V~ = LA(Q, K, V; g)
    return la_forward(q, k, mid, g, second, 1.0, rounds, split)


def gate_grad_forms(x: dict, do: torch.Tensor, dfinal: torch.Tensor, rnd: bool) -> dict[str, torch.Tensor]:
    """linear_attn's dg [B, T, H] as its bf16 Triton backward computes it (rnd: the kernels' roundings; else exact),
    in the three forms hilo has used, from the same per-token x_t = q_t . dq_t - k_t . dk_t:
      "document sum"   one reverse cumsum of x over the document (until session 14),
      "dstates pass"   per chunk <dS_out, S_out> from the sequential pass (fp32 dS) plus the in-chunk reverse sum,
      "chunk programs" at each chunk's first token exp(gl) <dS_out, S_in> + sum_t q_t . dq_t(through S_in), from the
                       bf16 tiles the chunk's program loads, less the in-chunk sum before each token (the committed).
    x as in benchmarks/kernels.py's check (initial state, final-state cotangent dfinal); one sequence per row."""
    q, k, v = (_bf16(x[n].double(), rnd) for n in ("q", "k", "v"))
    g, h0 = x["g"].double(), x["initial_state"].double()
    do, dfinal = _bf16(do.double(), rnd), dfinal.double()
    t, d = q.shape[1], q.shape[-1]
    scale = d ** -0.5
    chunks = [slice(c, min(c + CHUNK, t)) for c in range(0, t, CHUNK)]
    entering, final = entering_states(k, v, g, h0, rnd, rnd)  # the forward's stored states (bf16 in the kernels)
    dstate, d_out, d_out32 = dfinal.clone(), [None] * len(chunks), [None] * len(chunks)
    for c in reversed(range(len(chunks))):  # the dstates pass: dS leaving each chunk (stored bf16; fp32 in-pass)
        sl = chunks[c]
        d_out[c], d_out32[c] = _bf16(dstate, rnd), dstate.clone()
        gc = g[:, sl].cumsum(1)
        queries = _bf16(q[:, sl] * (gc.exp() * scale)[..., None], rnd)
        dstate = dstate * gc[:, -1].exp()[..., None, None] + torch.einsum("bthk,bthv->bhkv", queries, do[:, sl])
    xs, first, after = [], [], []
    tril = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
    for c, sl in enumerate(chunks):
        qc, kc, vc, doc = q[:, sl], k[:, sl], v[:, sl], do[:, sl]
        gc = g[:, sl].cumsum(1)
        gl, gt, n = gc[:, -1], gc.transpose(1, 2), qc.shape[1]
        decay = torch.where(tril[:n, :n], (gt[..., :, None] - gt[..., None, :]).clamp(max=0).exp(), 0.0)
        d_scores = _bf16(torch.einsum("bihv,bjhv->bhij", doc, vc) * decay * scale, rnd)
        dq_state = torch.einsum("bthv,bhkv->bthk", doc, entering[c]) * (gc.exp() * scale)[..., None]
        dq = dq_state + torch.einsum("bhij,bjhk->bihk", d_scores, kc)
        dk = (torch.einsum("bthv,bhkv->bthk", vc, d_out[c]) * (gl[:, None] - gc).exp()[..., None]
              + torch.einsum("bhij,bihk->bjhk", d_scores, qc))
        xs.append((qc * dq).sum(-1) - (kc * dk).sum(-1))
        first.append(gl.exp() * (entering[c] * d_out[c]).sum((-2, -1)) + (qc * dq_state).sum((1, 3)))
        leaving = entering[c + 1] if c + 1 < len(chunks) else final
        after.append((d_out32[c] * leaving).sum((-2, -1)))
    xall = torch.cat(xs, 1)
    xall[:, -1] += (final * dfinal).sum((-2, -1))  # the final state's term at the last token
    return {"document sum": xall.flip(1).cumsum(1).flip(1),
            "dstates pass": torch.cat([b[:, None] + xc.flip(1).cumsum(1).flip(1) for b, xc in zip(after, xs)], 1),
            "chunk programs": torch.cat([b[:, None] - (xc.cumsum(1) - xc) for b, xc in zip(first, xs)], 1)}


def gate_grad_table(x: dict, seed: int = 11) -> list[str]:
    """bf16 error ratio of each form's dg against the exact value (check inputs and cotangents of kernels.py)."""
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(x["v"].shape, generator=gen)
    dfinal = torch.randn(x["initial_state"].shape, generator=gen)
    exact = gate_grad_forms(x, do, dfinal, False)["document sum"]
    got = gate_grad_forms(x, do, dfinal, True)
    return ["| dg form | bf16 error ratio |", "|---|---|"] + [
        f"| {name} | {error_ratio(dg, exact):.2e} |" for name, dg in got.items()]


def table(ops, x) -> list[str]:
    lines = ["| op | rounding | alone | all but it |", "|---|---|---|---|"]
    for op in ops:
        every = set(ROUNDINGS) - ({"intermediate"} if op == "linear_attn" else set())
        ref = forward(op, x, set())
        lines.append(f"| {op} | all | {error_ratio(forward(op, x, every), ref):.2e} | - |")
        lines.append(f"| {op} | all, split_scores | {error_ratio(forward(op, x, every, split=True), ref):.2e} | - |")
        for name in sorted(every):
            alone = error_ratio(forward(op, x, {name}), ref)
            rest = error_ratio(forward(op, x, every - {name}), ref)
            lines.append(f"| {op} | {name} | {alone:.2e} | {rest:.2e} |")
    return lines


def main(argv=None) -> None:
    from benchmarks.kernels import _make_hla, _make_linear_attn

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=777)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dim", type=int, default=128)
    ops = ["linear_attn", "hla2", "ahla"]
    ap.add_argument("--ops", nargs="+", default=ops, choices=ops)
    ap.add_argument("--dg", action="store_true", help="instead: linear_attn's backward dg in its three forms")
    args = ap.parse_args(argv)
    shape = (args.batch, args.seq_len, args.heads, args.dim, "cpu")
    if args.dg:
        print("\n".join(gate_grad_table(_make_linear_attn(*shape, seed=0, n_state=args.batch))))
        return
    for op in args.ops:
        x = (_make_linear_attn if op == "linear_attn" else _make_hla)(*shape, seed=0, n_state=args.batch)
        print("\n".join(table([op], x)[0 if op == args.ops[0] else 2:]))


if __name__ == "__main__":
    main()
