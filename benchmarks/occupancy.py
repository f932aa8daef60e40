"""Programs of one Triton launch that fit on an H200 (sm_90) multiprocessor at once, from its resources (as
benchmarks/triton_resources.py reports them). Kept apart from that script, which patches Triton's launcher on
import."""

SM_SHARED, SM_REGS, SM_WARPS, SM_PROGRAMS = 233472, 65536, 64, 32  # per sm_90 multiprocessor


def programs_per_sm(regs: int, shared: int, warps: int) -> int:
    """How many programs of `warps` warps, `regs` registers a thread and `shared` bytes of shared memory fit on one
    sm_90 multiprocessor: registers go to warps in units of 256, each program's shared memory takes 1 KB more for the
    system, and an SM holds at most 64 warps and 32 programs (the CUDA occupancy rules)."""
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = (SM_REGS // per_warp) // warps if per_warp else SM_PROGRAMS
    return max(0, min(by_regs, SM_SHARED // (shared + 1024), SM_WARPS // warps, SM_PROGRAMS))
