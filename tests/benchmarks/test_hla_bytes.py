"""benchmarks/hla_bytes.py: the fused hla2's byte count follows its data flow (each per-chunk state is written by
one scan and read by two chunk launches; K~ is written once and read by four launches) and its CLI names bad input."""
import pytest

from benchmarks.hla_bytes import BT, launch_bytes, main


def test_storage_options_save_exactly_their_tensors():
    b, t, h, dk, dv = 2, 1000, 3, 48, 80  # a partial last chunk: rows = b * ceil(t / BT)
    rows = b * -(-t // BT)
    full = sum(launch_bytes(b, t, h, dk, dv).values())
    states16 = sum(launch_bytes(b, t, h, dk, dv, state_bytes=2).values())
    both = sum(launch_bytes(b, t, h, dk, dv, state_bytes=2, mid_bytes=2).values())
    # S, dS (K x K) and F, dF (K x V): 3 touches each (one write, two reads), 2 bytes saved per element
    assert full - states16 == 2 * 3 * rows * h * dk * (dk + dv) * 2
    # K~ [B*T, H, K]: one write and four reads (scan F, out o, the outer dvalues and dqk)
    assert states16 - both == 5 * b * t * h * dk * 2
    assert len(launch_bytes(b, t, h, dk, dv)) == 10  # 4 forward launches, 6 backward


def test_cli_table_and_errors(capsys):
    main(["--seq-len", "16384", "--batch", "2", "--heads", "16", "--dim", "128"])
    out = capsys.readouterr().out
    assert "| total GB | 12.88 | 9.66 | 8.99 |" in out and "| floor ms | 3.07 | 2.30 | 2.14 |" in out
    with pytest.raises(SystemExit, match="--heads must be positive"):
        main(["--heads", "0"])
