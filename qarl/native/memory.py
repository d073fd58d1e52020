"""How the process's allocator serves a training step's large, short-lived tensors.

glibc's malloc serves every block above its mmap threshold (128 KiB, raised on the fly up to
32 MiB) with a fresh `mmap` and hands it back to the kernel on `free`, and trims the heap top
above 128 KiB. A training step allocates and frees gigabytes of activations, gradients and
logits chunks in blocks of 1-100 MiB, so each new tensor's every page would be faulted in and
zeroed by the kernel again, step after step: a visible share of the update's system time
(benchmarks/step_time.py measures it; QARL_MALLOC=default there measures glibc's own).
`tune_allocator` raises the mmap threshold to 1 GiB and turns the trim off: freed blocks stay
in the heap and the next step reuses them (a finite trim threshold still let some steps hand
the heap top back and fault it in again). The resident size stays at the step's peak between
steps; the peak itself does not grow.

Huge pages: torch's CPU allocator advises the kernel to back blocks of 2 MiB and more with
transparent huge pages when THP_MEM_ALLOC_ENABLE=1 is set before its first allocation;
`qarl.ask_huge_pages()` sets it where torch is not imported yet (the `qarl` command calls it
first thing). A first step grows the heap to the step's peak, and with huge pages it faults
it in a fraction of the page faults. `huge_pages()` says whether it holds in this process.
tests/unit/native/test_native.py counts the page faults of a step's blocks either way.

It acts only on glibc (Linux), once per process, and not at all when the environment already
tunes malloc (`GLIBC_TUNABLES` naming glibc.malloc) or `QARL_MALLOC=default` asks for the
allocator's own behaviour (which also leaves huge pages off).
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h>
MMAP_THRESHOLD = 1 << 30  # bytes
NEVER_TRIM = -1  # mallopt takes an int; glibc stores the trim threshold as size_t: SIZE_MAX
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # read by torch's CPU allocator (c10/core/alloc_cpu.cpp)
THP_SYSFS = "/sys/kernel/mm/transparent_hugepage/enabled"
ENV = "QARL_MALLOC"

_state: dict[str, str] = {}


def tune_allocator() -> str:
    """Raise glibc's mmap threshold and turn its trim off (module docstring), once per
    process. -> what was done, for describe() and benchmark JSON: "tuned", or why not."""
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
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, NEVER_TRIM)):
        return "glibc default (mallopt refused the thresholds)"
    return "tuned"


def huge_pages() -> str:
    """Whether torch's CPU allocator asks for transparent huge pages in this process: "on", or
    why not (module docstring)."""
    asked = os.environ.get(THP_ENV)
    if asked != "1":
        if asked is not None:
            return f"off ({THP_ENV}={asked})"
        if os.environ.get(ENV, "") == "default":
            return f"off ({ENV}=default)"
        return (f"off (not asked: call qarl.ask_huge_pages() before importing torch, or set "
                f"{THP_ENV}=1)")
    try:
        with open(THP_SYSFS) as f:
            mode = f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "asked (the kernel has no transparent huge pages)"
    return "off (kernel: transparent_hugepage never)" if mode == "never" else "on"
