"""The cache lock several qarl processes share: one prepares an entry, the others wait, and a
stop signal ends a wait instead of being held back until the entry is ready."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from qarl.paths import cache_lock
from qarl.train.signals import StopRequested


def test_a_waiter_enters_once_the_holder_leaves(tmp_path):
    entry = tmp_path / "sft" / "key"
    held, release = threading.Event(), threading.Event()

    def holder():
        with cache_lock(entry):  # its own open file: flock excludes it from ours
            held.set()
            release.wait(5)

    thread = threading.Thread(target=holder)
    thread.start()
    held.wait(5)
    threading.Timer(0.5, release.set).start()
    began = time.monotonic()
    with cache_lock(entry):
        waited = time.monotonic() - began
    thread.join()
    assert waited >= 0.45  # it waited for the holder, then got the lock
    assert (tmp_path / "sft" / ".key.lock").exists()


def test_a_stop_ends_the_wait(tmp_path):
    entry = tmp_path / "sft" / "key"
    checks = []

    def check():  # as check_stop after a SIGTERM arrived during the third wait
        checks.append(time.monotonic())
        if len(checks) == 3:
            raise StopRequested(signal.SIGTERM)

    with cache_lock(entry):
        with pytest.raises(StopRequested):
            with cache_lock(entry, check):
                pytest.fail("entered a lock another holder has")
    assert len(checks) == 3
    with cache_lock(entry, check=lambda: pytest.fail("a free lock has no wait")):
        pass
