"""How the process's allocator serves a training step's large, short-lived tensors.

glibc's malloc serves every block above its mmap threshold (128 KiB, raised on the fly up to
32 MiB) with a fresh `mmap` and hands it back to the kernel on `free`, and trims the heap top
above 128 KiB. A training step allocates and frees gigabytes of activations, gradients and
logits chunks in blocks of 1-100 MiB, so each new tensor's every page is faulted in and
zeroed by the kernel again, step after step; on a 2-core VM that was 15-25% of the update
(docs/benchmarks.md). `tune_allocator` sets both thresholds to 1 GiB: freed blocks stay in
the heap and the next step reuses them (the resident size stays near the step's peak instead
of falling between steps; the peak itself is measured in the same benchmark).

It acts only on glibc (Linux), once per process, and not at all when the environment already
tunes malloc (`GLIBC_TUNABLES` naming glibc.malloc) or `QARL_MALLOC=default` asks for the
allocator's own behaviour.
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
THRESHOLD = 1 << 30  # bytes, both thresholds
ENV = "QARL_MALLOC"

_state: dict[str, str] = {}


def tune_allocator() -> str:
    """Raise glibc's mmap and trim thresholds (module docstring), once per process. -> what
    was done, for describe() and benchmark JSON: "tuned", or why not."""
    if "result" not in _state:
        _state["result"] = _tune()
    return _state["result"]


def allocator() -> str:
    """What `tune_allocator` did in this process ("untouched" before it ran)."""
    return _state.get("result", "untouched")


def _tune() -> str:
    if os.environ.get(ENV, "") == "default":
        return f"glibc default ({ENV}=default)"
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return "as GLIBC_TUNABLES sets it"
    if not sys.platform.startswith("linux"):
        return f"platform default ({sys.platform})"
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "platform default (no mallopt: not glibc)"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if not (mallopt(M_MMAP_THRESHOLD, THRESHOLD) and mallopt(M_TRIM_THRESHOLD, THRESHOLD)):
        return "glibc default (mallopt refused the thresholds)"
    return "tuned"
