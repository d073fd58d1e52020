"""A reward worker process: `python -c ENTRY READ_FD WRITE_FD`.

Started by `RewardRunner` as a fresh interpreter (never a fork: safe when the parent has torch
and its thread pools loaded, and unlike multiprocessing's spawn/forkserver it never re-imports
the parent's `__main__`, so a script that calls `qarl.train()` without an
`if __name__ == "__main__"` guard still works). Protocol over two pipes, pickled by
`multiprocessing.connection.Connection`:

    parent -> worker   (spec, sys_path)            once, first
    worker -> parent   ("ready", None) | ("init_error", message)
    parent -> worker   (index, (prompt, completion, fields)) ... and None to stop
    worker -> parent   (index, (outcome, reward or message))

The worker exits when told to, or when the parent goes away (its pipe closes).
"""

from __future__ import annotations

import math
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any

from qarl.tasks.rewards import load_reward


def describe(exc: BaseException) -> str:
    """'Type: message (at file:line in function)' of an exception raised by a reward."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        last = frames[-1]
        text += f" (at {last.filename}:{last.lineno} in {last.name})"
    return text


def score_one(fn: Any, prompt: str, completion: str, fields: dict[str, Any]) -> tuple[str, Any]:
    """(outcome, reward or error message) of one reward call, exceptions included."""
    try:
        value = fn(prompt, completion, **fields)
    except Exception as e:  # a user reward may raise anything; it becomes a counted outcome
        return "error", describe(e)
    if value is None:
        return "unscorable", None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return "error", (
            f"reward returned {value!r} ({type(value).__name__}); a reward returns a finite "
            "float, or None when the completion cannot be scored"
        )
    return "ok", float(value)


def serve(inbox: Connection, outbox: Connection) -> None:
    """Load the reward named by the first message, report, then answer calls until None."""
    spec, parent_sys_path = inbox.recv()
    sys.path[:] = parent_sys_path  # what a user's "module:function" was written against
    try:
        fn = load_reward(spec)
    except Exception as e:
        outbox.send(("init_error", describe(e)))
        return
    outbox.send(("ready", None))
    while True:
        try:
            job = inbox.recv()
        except EOFError:  # the parent is gone
            return
        if job is None:
            return
        index, (prompt, completion, fields) = job
        outbox.send((index, score_one(fn, prompt, completion, fields)))


def serve_fds(read_fd: int, write_fd: int) -> None:
    """`serve` over two inherited pipe file descriptors."""
    serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False))


# `-c` rather than `-m qarl.tasks.worker`: the package imports this module, and running it
# again as __main__ would load it twice.
ENTRY = "import sys; from qarl.tasks.worker import serve_fds; serve_fds(*map(int, sys.argv[1:]))"
