"""Learner-rank start-up faults: nothing waits for the 24-hour collective timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from qarl.parallel.launch import LocalRank, wait_for_followers
from qarl.parallel.ranks import LearnerRankDied


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_a_follower_that_exits_before_joining_is_reported_at_once(tmp_path):
    """Rank 1 marks itself ready; rank 2 exits with code 3 before marking: rank 0's wait
    raises LearnerRankDied naming rank 2 and its exit code, as soon as it has exited."""
    init = str(tmp_path / "init")
    ready = _python(f"open({init + '.ready1'!r}, 'w').close()")
    dies = _python("import sys; sys.exit(3)")
    start = time.monotonic()
    with pytest.raises(LearnerRankDied, match=r"learner rank 2 of 3 ended \(exit code 3\) before"):
        wait_for_followers([LocalRank(ready, init, 1), LocalRank(dies, init, 2)], timeout_s=60)
    assert time.monotonic() - start < 30  # the exit is seen, not the timeout


def test_followers_that_mark_themselves_ready_are_waited_for(tmp_path):
    """Two followers that mark themselves ready (one after a delay, both still running): the
    wait returns after the slower one has marked, without raising."""
    init = str(tmp_path / "init")
    quick = _python(f"import time; open({init + '.ready1'!r}, 'w').close(); time.sleep(5)")
    slow = _python(f"import time; time.sleep(1); open({init + '.ready2'!r}, 'w').close(); "
                   "time.sleep(5)")
    try:
        wait_for_followers([LocalRank(quick, init, 1), LocalRank(slow, init, 2)], timeout_s=60)
        assert os.path.exists(init + ".ready2")
    finally:
        for p in (quick, slow):
            p.kill()
            p.wait()


def test_a_follower_that_neither_joins_nor_dies_hits_the_join_timeout(tmp_path):
    """A follower that hangs before marking itself ready: LearnerRankDied after timeout_s,
    naming the rank."""
    hangs = _python("import time; time.sleep(60)")
    try:
        with pytest.raises(LearnerRankDied, match=r"learner ranks \[1\] did not start within 1 s"):
            wait_for_followers([LocalRank(hangs, str(tmp_path / "init"), 1)], timeout_s=1)
    finally:
        hangs.kill()
        hangs.wait()


@pytest.mark.parametrize("parent_ends", ["after the call", "before the call"])
def test_an_orphaned_follower_exits(tmp_path, parent_ends):
    """A process that called exit_with_parent(its parent's pid, 0.1) ends within seconds of
    its parent's end, also when the parent ended before the call (its parent here: a shell
    that starts it in the background, writes its pid and exits)."""
    pid_file, called = tmp_path / "pid", tmp_path / "called"
    delay = 2 if parent_ends == "before the call" else 0
    child = (f"import sys, time; from qarl.parallel.launch import exit_with_parent; "
             f"time.sleep({delay}); exit_with_parent(int(sys.argv[1]), 0.1); "
             f"open({str(called)!r}, 'w').close(); time.sleep(60)")
    # for "after the call" the shell outlives the call: it waits for the child's marker
    wait = "" if delay else f"while [ ! -e {called} ]; do sleep 0.1; done"
    subprocess.run(["sh", "-c", f'"{sys.executable}" -c "{child}" $$ & echo $! > {pid_file}; '
                    f"{wait}"], check=True, timeout=120)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), f"orphaned process {pid} still running 30 s after its parent ended"
    assert called.exists() == (not delay)  # a parent gone before the call: ends in the call


def _alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting for init to reap it counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
