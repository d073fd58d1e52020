"""Stopping on SIGTERM / SIGINT: a flag set by the signal, checked where it is safe to stop.

The handler only records the signal; `check_stop()` raises `StopRequested` once one arrived.
The trainer calls it between the phases of a step that come before the update, once per
decode step inside generation (`LocalEngine.stop_check`) and while waiting for rewards
(`RewardRunner.stop_check`); never inside the update, the weight sync or a checkpoint write,
so a stop always finds the weights of a whole number of steps. The first signal also puts
the previous handlers back: a second SIGINT / SIGTERM acts as it would without qarl.

A stop signal that arrived before the block began, while the command loaded, is `note`d by
the command's own handler (qarl.cli), whose exception may have been swallowed on the way (a
library's bare `except:` around an optional import): the block starts with it set, so the
run stops at its first check instead of running to its end.

The flag is module state because signals are process state: one run per process.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)

_received: int | None = None  # the signal number once one arrived
_noted: int | None = None  # one that arrived before `stop_on_signals` began (`note`)


class StopRequested(Exception):
    """A SIGTERM / SIGINT arrived; raised by `check_stop` where work may stop."""

    def __init__(self, signum: int):
        super().__init__(f"{signal.Signals(signum).name} received")
        self.signum = signum


def note(signum: int | None) -> None:
    """Record a stop signal that arrived outside `stop_on_signals` (module docstring); None
    forgets it (a command that ended)."""
    global _noted
    _noted = signum


def check_stop() -> None:
    """Raise StopRequested if a stop signal arrived since `stop_on_signals` began (or was
    noted before it)."""
    if _received is not None:
        raise StopRequested(_received)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGTERM and SIGINT set the flag `check_stop` reads instead of
    ending the process. Outside the main thread signals cannot be handled: nothing changes."""
    global _received, _noted
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}

    def record(signum, frame):
        global _received
        _received = signum
        for s, handler in previous.items():
            signal.signal(s, handler)

    _received, _noted = _noted, None  # one noted while the command loaded: stop at once
    for s in SIGNALS:
        signal.signal(s, record)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _received = None
