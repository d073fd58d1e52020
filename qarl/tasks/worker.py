"""A reward worker process: `python -c ENTRY READ_FD WRITE_FD`.

Started by `RewardRunner` as a fresh interpreter (never a fork: safe when the parent has torch
and its thread pools loaded, and unlike multiprocessing's spawn/forkserver it never re-imports
the parent's `__main__`, so a script that calls `qarl.train()` without an
`if __name__ == "__main__"` guard still works). Protocol over two pipes, one JSON document
per message (`send` / `receive`: length-prefixed bytes, never pickles, so nothing a reward
returns is ever unpickled by the trainer):

    parent -> worker   {"spec": ..., "sys_path": [...]}       once, first
    worker -> parent   {"ready": true} | {"init_error": message}
    parent -> worker   {"index": i, "prompt": ..., "completion": ..., "fields": {...}} ...
                       or, for a batched reward, {"index": i, "prompts": [...],
                       "completions": [...], "fields": {name: [...]}}; and null to stop
    worker -> parent   {"index": i, "outcome": ..., "value": reward or message}, or for a
                       batch {"index": i, "results": [[outcome, value], ...]} (a batch call
                       that raised answers one outcome for all)

Reward fields are JSON values: a call whose fields are not (`encode_call` raises) is an
`error` outcome before it reaches a worker. The worker ignores SIGINT (a Ctrl-C reaches the
whole process group; the parent decides) and exits when told to or when the parent goes away
(its pipe closes), quietly even in the middle of a call.
"""

from __future__ import annotations

import json
import math
import numbers
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

from qarl.tasks.rewards import last_frame, load_reward


def describe(exc: BaseException) -> str:
    """'Type: message (at file:line in function)' of an exception raised by a reward."""
    return last_frame(exc)


def send(conn: Connection, message: Any) -> None:
    conn.send_bytes(json.dumps(message).encode())


def receive(conn: Connection) -> Any:
    """The next message; EOFError once the other end has closed."""
    return json.loads(conn.recv_bytes())


def encode_call(index: int, prompt: str, completion: str, fields: dict[str, Any]) -> bytes:
    """A call as the message sent to a worker; TypeError / ValueError when a field is not a
    JSON value."""
    return json.dumps({"index": index, "prompt": prompt, "completion": completion,
                       "fields": fields}).encode()


def batch_fields(fields: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Per-call field dicts as one list per field name (names in order of first appearance),
    None where a call lacks the field: the keyword arguments of a batched reward."""
    names = list(dict.fromkeys(name for call in fields for name in call))
    return {name: [call.get(name) for call in fields] for name in names}


def encode_batch(index: int, prompts: list[str], completions: list[str],
                 fields: dict[str, list[Any]]) -> bytes:
    """A batch (one call of a batched reward) as the message sent to a worker."""
    return json.dumps({"index": index, "prompts": prompts, "completions": completions,
                       "fields": fields}).encode()


def score_one(fn: Any, prompt: str, completion: str, fields: dict[str, Any]) -> tuple[str, Any]:
    """(outcome, reward or error message) of one reward call, exceptions included."""
    try:
        value = fn(prompt, completion, **fields)
    except Exception as e:  # a user reward may raise anything; it becomes a counted outcome
        return "error", describe(e)
    return judge(value)


def judge(value: Any) -> tuple[str, Any]:
    """(outcome, reward or message) of one value a reward returned: a finite real number is
    `ok` (as a float), None is `unscorable`, anything else an `error`."""
    if value is None:
        return "unscorable", None
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not math.isfinite(value)):
        return "error", (
            f"reward returned {value!r} ({type(value).__name__}); a reward returns a finite "
            "float, or None when the completion cannot be scored"
        )
    return "ok", float(value)


def score_batch(fn: Any, prompts: list[str], completions: list[str],
                fields: dict[str, list[Any]]) -> tuple[str, Any] | list[tuple[str, Any]]:
    """One call of a batched reward `fn(prompts, completions, **fields) -> sequence of
    float | None`: one (outcome, value) per completion, or a single (outcome, message) for the
    whole batch when the call raised or returned something that is not one value per
    completion."""
    try:
        values = fn(prompts, completions, **fields)
    except Exception as e:  # as in score_one: counted, for every completion of the batch
        return "error", describe(e)
    if isinstance(values, str | bytes | dict) or not hasattr(values, "__len__"):
        return "error", (f"batched reward returned {type(values).__name__}; it returns a list "
                         f"of {len(completions)} float | None, one per completion")
    values = list(values)
    if len(values) != len(completions):
        return "error", (f"batched reward returned {len(values)} values for "
                         f"{len(completions)} completions; it returns one per completion")
    return [judge(v.item() if hasattr(v, "item") else v) for v in values]


def serve(inbox: Connection, outbox: Connection) -> None:
    """Load the reward named by the first message, report, then answer calls until null."""
    first = receive(inbox)
    sys.path[:] = first["sys_path"]  # what a user's "module:function" was written against
    try:
        fn = load_reward(first["spec"])
    except Exception as e:
        send(outbox, {"init_error": describe(e)})
        return
    send(outbox, {"ready": True})
    while True:
        try:
            job = receive(inbox)
        except EOFError:  # the parent is gone
            return
        if job is None:
            return
        if "prompts" in job:
            scored = score_batch(fn, job["prompts"], job["completions"], job["fields"])
            if isinstance(scored, list):
                send(outbox, {"index": job["index"], "results": scored})
                continue
        else:
            scored = score_one(fn, job["prompt"], job["completion"], job["fields"])
        send(outbox, {"index": job["index"], "outcome": scored[0], "value": scored[1]})


def serve_fds(read_fd: int, write_fd: int) -> None:
    """`serve` over two inherited pipe file descriptors. A parent gone mid-call (its pipes
    closed: the trainer was killed) ends the worker quietly: nobody is left to answer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False))
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass


# `-c` rather than `-m qarl.tasks.worker`: the package imports this module, and running it
# again as __main__ would load it twice.
ENTRY = "import sys; from qarl.tasks.worker import serve_fds; serve_fds(*map(int, sys.argv[1:]))"
