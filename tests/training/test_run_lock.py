"""The run-directory lock: a second process is kept out with the holder's PID and host; the lock dies with its
process, even under kill -9."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from tests.training.helpers import REPO
from training.run_lock import RunLock, RunLockedError

HOLD = """
import sys, time
sys.path.insert(0, {repo!r})
from training.run_lock import RunLock
RunLock({run_dir!r}).acquire()
print("locked", flush=True)
time.sleep(600)
"""


@pytest.fixture()
def holder(tmp_path):
    """A live process holding the lock on tmp_path/run."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD.format(repo=str(REPO), run_dir=str(run_dir))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield run_dir, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_second_process_is_kept_out_and_told_who_holds_it(holder):
    run_dir, proc = holder
    with pytest.raises(RunLockedError, match=rf"pid {proc.pid} on host {socket.gethostname()}.*name=<new name>"):
        RunLock(run_dir).acquire()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_lock_dies_with_its_process(holder, sig):
    run_dir, proc = holder
    os.kill(proc.pid, sig)
    proc.wait()
    lock = RunLock(run_dir).acquire()  # the .lock file is still there; the flock is not
    assert lock.held and (run_dir / ".lock").exists()
    lock.release()


def test_release_lets_the_next_run_in(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        assert lock.held
        with pytest.raises(RunLockedError, match=f"pid {os.getpid()}"):
            RunLock(tmp_path / "run").acquire()  # another open file of the same process is kept out too
    RunLock(tmp_path / "run").acquire().release()
