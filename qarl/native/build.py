"""Compile qarl's C files (kernels.c, kernels_s8.c, attention.c, decode.c, logprobs.c,
bytes.c) once per machine and load them with ctypes.

The shared library is built on first use with the system C compiler (no torch headers, so it
is quick; the sources compile in parallel, then link) into
`$QARL_HOME/kernels/qarl_cpu-<hash>.so`, the hash covering the source, the flags and the
compiler, and is loaded after torch so that its OpenMP calls use the libgomp torch already
loaded (one thread pool, not two spinning against each other). Nothing is compiled at
install time, so `pip install` needs no compiler; without one, or on a CPU
without AVX2/FMA, `load()` returns None and says why in `why_unavailable()`, and qarl keeps
its PyTorch kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch  # noqa: F401  (loaded first: its libgomp is the one kernels.c links against)

from qarl.native.isa import cpu_flags, usable_cores
from qarl.paths import cache_lock, qarl_home

SOURCES = [Path(__file__).with_name(name)
           for name in ("kernels.c", "kernels_s8.c", "attention.c", "decode.c", "logprobs.c",
                        "bytes.c")]
# included by the sources: part of the hash
HEADERS = [Path(__file__).with_name(name) for name in ("simd.h", "kernels.h", "kernels_s8_tile.h")]
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared", "-std=c11"]
DISABLE_ENV = "QARL_NATIVE"  # QARL_NATIVE=0 turns the native kernels off

_state: dict = {}


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cache_dir() -> Path:
    return qarl_home() / "kernels"


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(
        b"".join(src.read_bytes() for src in SOURCES + HEADERS)
        + " ".join(FLAGS).encode() + version.encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"qarl_cpu-{digest}.so"
    if target.exists():
        return target
    # one builder at a time per QARL_HOME: processes started together on a fresh machine
    # (`qarl compare`'s runs, two first runs) wait for the first one's build, not run their own
    with cache_lock(target.parent / "build"):
        if target.exists():
            return target
        # compile beside the target, then rename: a loader never sees half a file
        with tempfile.TemporaryDirectory(dir=target.parent) as work:
            tmp = Path(work) / target.name
            _compile(cc, Path(work), tmp)
            os.replace(tmp, target)
    # builds of other sources (older qarl versions) are never loaded again by this one: drop
    # them (a process that has one loaded keeps its mapping)
    for stale in target.parent.glob("qarl_cpu-*.so"):
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def _compile(cc: str, work: Path, out: Path) -> None:
    """Each source into an object file in `work`, as many compilers at a time as this process
    may use cores (the first build is a user's first run's wait), then one link into `out`."""
    flags = [f for f in FLAGS if f != "-shared"]
    jobs = min(len(SOURCES), usable_cores())
    objects = [work / f"{src.stem}.o" for src in SOURCES]
    running: list[tuple[Path, subprocess.Popen]] = []
    failed: list[tuple[str, str]] = []

    def finish(src: Path, proc: subprocess.Popen) -> None:
        _, err = proc.communicate()
        if proc.returncode != 0:
            failed.append((src.name, err))

    for src, obj in zip(SOURCES, objects):
        if len(running) == jobs:
            finish(*running.pop(0))
        running.append((src, subprocess.Popen([cc, *flags, "-c", str(src), "-o", str(obj)],
                                              stderr=subprocess.PIPE, text=True)))
    for src, proc in running:
        finish(src, proc)
    if not failed:
        done = subprocess.run([cc, *FLAGS, *map(str, objects), "-lm", "-o", str(out)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            failed.append(("the link", done.stderr))
    if failed:
        what, err = failed[0]
        raise RuntimeError(f"{cc} failed to build {[src.name for src in SOURCES]} ({what}):\n"
                           f"{err[-2000:]}")


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    signatures = {
        "qarl_pack_f32": [p, i64, i64, i64, p, i32],
        "qarl_linear_f32": [p, i64, i64, i64, p, i64, p, p, i64, p, i64, i32],
        "qarl_pack_s8": [p, i64, i64, i64, p, i32],
        "qarl_pack_s8_t": [p, i64, i64, i64, p, i32],
        "qarl_linear_s8_dynamic": [p, i64, i64, i64, p, p, i64, p, i64, i32],
        "qarl_linear_s8_codes": [p, i64, i64, i64, p, p, p, i64, p, i64, i32],
        "qarl_quantize_s8_rows": [p, i64, i64, i64, p, i64, p, i32],
        "qarl_qdq_s8_rows_bf16": [p, i32, i64, i64, i64, p, i64, i32],
        "qarl_dequant_s8_bf16": [p, p, i64, i64, p, i32],
        "qarl_dequant_s8_f32": [p, p, i64, i64, p, i32],
        "qarl_qdq_s8_rows_f32": [p, i64, i64, i64, p, i64, i32],
        "qarl_quantize_s8_rows_scaled": [p, i64, i64, i64, p, p, i64, p, i32],
        "qarl_scale_s32": [p, i64, i64, p, p, p, i32],
        "qarl_s8_isa": [],
        "qarl_s8_set_isa": [i32],
        "qarl_f32_isa": [],
        "qarl_f32_set_isa": [i32],
        "qarl_pack_u4": [p, i64, i64, i64, p, i32],
        "qarl_quantize_u4": [p, i64, i64, i64, i64, i32, p, p, p, p, i32],
        "qarl_linear_u4": [p, i64, i64, i64, p, p, p, i64, i64, i32, p, i64, i32],
        "qarl_round_bf16_row": [p, i64, p],
        "qarl_decode_attention": [p, i64, i64, i64, i64, p, p, f32, p, p, i64, p, p, i64, i64,
                                  i64, i64, p, i64, f32, p, p, i32],
        "qarl_rms_norm": [p, i64, i64, i64, p, f32, p, i64, i32],
        "qarl_silu_mul": [p, i64, i64, p, i32],
        "qarl_decode_block": [p, p, i64, p, p, i64, p, p, i64, i64, i64, i64, p, i64, i32],
        "qarl_sample_rows": [p, i64, i64, i64, f32, p, p, p, p, i32],
        "qarl_token_logp": [p, i32, i64, i64, i64, p, f32, p, p, p, i32],
        "qarl_token_logp_backward": [p, i32, i64, i64, i64, p, f32, p, p, p, i64, i32],
        "qarl_crc32": [p, i64, ctypes.c_uint32],
        "qarl_count_changed_bytes": [p, p, i64, i32],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    for name in ("qarl_s8_isa", "qarl_s8_set_isa", "qarl_f32_isa", "qarl_f32_set_isa"):
        getattr(lib, name).restype = i32
    lib.qarl_crc32.restype = ctypes.c_uint32
    lib.qarl_count_changed_bytes.restype = ctypes.c_int64
    return lib


def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None when this machine cannot run it."""
    if "lib" in _state:
        return _state["lib"]
    lib, why = None, None
    cc = _compiler()
    if os.environ.get(DISABLE_ENV, "1") == "0":
        why = f"turned off by {DISABLE_ENV}=0"
    elif platform.machine() not in ("x86_64", "AMD64"):
        why = f"the kernels are x86-64 AVX2 code; this machine is {platform.machine()}"
    elif not {"avx2", "fma"} <= cpu_flags():
        why = "this CPU lacks AVX2 or FMA"
    elif cc is None:
        why = "no C compiler found (install gcc, or set CC)"
    else:
        try:
            lib = _declare(ctypes.CDLL(str(_build(cc))))
        except (OSError, RuntimeError) as err:
            why = f"building the kernels failed: {err}"
    _state["lib"], _state["why"] = lib, why
    return lib


def why_unavailable() -> str | None:
    load()
    return _state["why"]
