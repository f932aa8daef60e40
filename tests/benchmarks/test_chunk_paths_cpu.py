"""benchmarks/chunk_paths_cpu.py: a small run times every op; bad sizes are refused with the flag's name."""
import pytest

from benchmarks import chunk_paths_cpu


def test_small_run_times_every_op(capsys):
    best = chunk_paths_cpu.main(["--batch", "1", "--seq-len", "130", "--heads", "2", "--dim", "8", "--repeats", "1"])
    assert set(best) == set(chunk_paths_cpu.OPS) and all(s > 0 for s in best.values())
    assert "delta_rule:" in capsys.readouterr().out


def test_bad_sizes_are_refused(capsys):
    with pytest.raises(SystemExit):
        chunk_paths_cpu.main(["--seq-len", "0"])
    assert "--seq-len must be at least 1, got 0" in capsys.readouterr().err
