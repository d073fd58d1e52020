"""Where qarl keeps what it prepares once per machine: `$QARL_HOME` (default `~/.cache/qarl`),
holding converted zoo models (`models/`), warm-start SFT results (`sft/`) and compiled native
kernels (`kernels/`), and the lock that lets several qarl processes fill it at once
(`cache_lock`). Imports nothing of qarl, so every package may ask it."""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def qarl_home() -> Path:
    """`$QARL_HOME`, default `~/.cache/qarl`."""
    return Path(os.environ.get("QARL_HOME") or Path.home() / ".cache" / "qarl").expanduser()


LOCK_POLL_S = 0.2  # how often a process waiting for a cache entry tries the lock again


@contextmanager
def cache_lock(entry: Path, check: Callable[[], None] | None = None) -> Iterator[None]:
    """An exclusive lock on one cache entry (a folder under `$QARL_HOME` being prepared), held
    in the block: other qarl processes preparing the same entry wait, then find it ready. The
    lock is a file beside the entry (`.<name>.lock`), released when the block ends or the
    process dies.

    A waiting process tries the lock every LOCK_POLL_S and calls `check` between tries
    (e.g. `qarl.train.signals.check_stop`), so a stop signal ends the wait instead of being
    held back until the other process has finished the entry."""
    entry = Path(entry)
    entry.parent.mkdir(parents=True, exist_ok=True)
    with open(entry.with_name(f".{entry.name}.lock"), "w") as handle:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if check is not None:
                    check()
                time.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
