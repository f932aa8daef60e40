"""benchmarks/occupancy.py: programs per sm_90 multiprocessor from a launch's resources."""

from benchmarks.occupancy import programs_per_sm


def test_programs_per_sm_limits():
    # registers: 128 a thread at 8 warps fit two programs (2 x 256 x 128 = 65536), 129 only one
    assert programs_per_sm(128, 0, 8) == 2 and programs_per_sm(129, 0, 8) == 1
    # 255 at 4 warps: 255 * 32 rounds up to 8192 a warp, 8 warps' worth: two programs
    assert programs_per_sm(255, 0, 4) == 2
    # shared memory: 1 KB more a program; 164 KB leaves one, 65 KB three
    assert programs_per_sm(32, 163840, 8) == 1 and programs_per_sm(32, 65536, 8) == 3
    # warps: 64 a multiprocessor; and never more than 32 programs
    assert programs_per_sm(16, 0, 16) == 4 and programs_per_sm(16, 0, 1) == 32
