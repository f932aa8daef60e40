"""The HBM bytes of the fused hla2's ten launches (kernels/hla/triton_fused.py) and the time they take at a given
bandwidth: a floor for the measured fwd+bwd, under fp32 storage and under HILO_HLA's states16 / mid16.

    python benchmarks/hla_bytes.py                       # 16K x 2, H = 16, K = V = 128, bf16 inputs, 4.2 TB/s
    python benchmarks/hla_bytes.py --seq-len 8192 --batch 4 --heads 32 --dim-v 64

Counting rule: every tensor a launch touches is read (or written) once per launch; re-reads inside a launch (the
column-block programs of one chunk reading the same q and k tiles) are taken to hit L2. Gates, chunk tables, scales
and the gate partials are left out (under 1% here). Arithmetic only, no measurement: the measured times are in
benchmarks/RESULTS.md, and this is what they are compared against.
"""

import argparse

BT = 64  # tokens per chunk (kernels.linear_attn.triton_fwd.BT)


def launch_bytes(batch: int, seq_len: int, heads: int, dk: int, dv: int, in_bytes: int = 2, state_bytes: int = 4,
                 mid_bytes: int = 4) -> dict[str, float]:
    """{launch: bytes} of hla2's forward and backward (decay "d1" or "d2", gated, no initial or final state).

    in_bytes: q, k, v, dO and the bf16 gradients; state_bytes: the per-chunk states (4 fp32, 2 with states16);
    mid_bytes: K~ (4, 2 with mid16). The backward's fp32 intermediates (dK~, dq of the outer pass, k's gradient as
    a value) stay 4 bytes."""
    tokens = batch * seq_len * heads
    rows = batch * -(-seq_len // BT)
    tok = lambda d, b: tokens * d * b  # a token tensor [B*T, H, d] of b-byte elements
    s_in = rows * heads * dk * dk * state_bytes  # S (K x K) for every chunk
    s_out = rows * heads * dk * dv * state_bytes  # F (K x V)
    q = k = tok(dk, in_bytes)
    v = do = tok(dv, in_bytes)
    mid = tok(dk, mid_bytes)
    f32k = tok(dk, 4)
    return {
        "fwd scan S (k, k -> S)": k + s_in,
        "fwd out K~ (q, k, S -> K~)": q + k + s_in + mid,
        "fwd scan F (K~, v -> F)": mid + v + s_out,
        "fwd out o (q, K~, v, F -> o)": q + mid + v + s_out + tok(dv, in_bytes),
        "bwd scan dF (q, dO -> dF)": q + do + s_out,
        "bwd outer dvalues (q, K~, dO, dF -> dv)": q + mid + do + s_out + tok(dv, in_bytes),
        "bwd outer dqk (q, K~, v, dO, F, dF -> dq', dK~)": q + mid + v + do + 2 * s_out + 2 * f32k,
        "bwd scan dS (q, dK~ -> dS)": q + f32k + s_in,
        "bwd inner dvalues (q, k, dK~, dS -> dk')": q + k + f32k + s_in + f32k,
        "bwd inner dqk (q, k, dK~, S, dS, dq', dk' -> dq, dk)": q + k + f32k + 2 * s_in + 2 * f32k + q + k,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dim-v", type=int, default=None, help="value head dim (default: --dim)")
    ap.add_argument("--tb-per-s", type=float, default=4.2, help="HBM bandwidth (SPEC §9's H200 device copy: 4.2)")
    args = ap.parse_args(argv)
    for name, value in (("--seq-len", args.seq_len), ("--batch", args.batch), ("--heads", args.heads),
                        ("--dim", args.dim), ("--tb-per-s", args.tb_per_s)):
        if value <= 0:
            raise SystemExit(f"{name} must be positive, got {value}")
    dv = args.dim_v or args.dim
    shape = (args.batch, args.seq_len, args.heads, args.dim, dv)
    print(f"hla2 fused, B = {args.batch}, T = {args.seq_len}, H = {args.heads}, K = {args.dim}, V = {dv}, bf16 inputs; "
          f"GB per launch, and the fwd+bwd floor at {args.tb_per_s} TB/s")
    storages = {"fp32 storage": (4, 4), "states16": (2, 4), "states16 + mid16": (2, 2)}
    tables = {label: launch_bytes(*shape, state_bytes=sb, mid_bytes=mb) for label, (sb, mb) in storages.items()}
    print("| launch | " + " | ".join(storages) + " |")
    print("|---|" + "---|" * len(storages))
    for launch in tables["fp32 storage"]:
        print(f"| {launch} | " + " | ".join(f"{t[launch] / 1e9:.2f}" for t in tables.values()) + " |")
    totals = {label: sum(t.values()) for label, t in tables.items()}
    print("| total GB | " + " | ".join(f"{v / 1e9:.2f}" for v in totals.values()) + " |")
    print("| floor ms | " + " | ".join(f"{v / (args.tb_per_s * 1e12) * 1e3:.2f}" for v in totals.values()) + " |")


if __name__ == "__main__":
    main()
