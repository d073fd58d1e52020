"""What this CPU can do, read once from /proc/cpuinfo: its name, its x86 feature flags, and
the instruction-set levels qarl's kernels and benchmarks name (`isa_levels`).

The CPUs qarl runs on vary (AVX2 only; AVX-512 with VNNI; AVX512-BF16 and AMX as well), and
several results depend on which: the speed of every GEMM, and the arithmetic of vLLM's int8
kernels (qarl.rollout.vllm_support). Every benchmark's JSON carries `machine()` so a figure
always names the CPU it came from.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# ISA levels, lowest first: (name, the flags that make it)
LEVELS = (
    ("avx2", ("avx2", "fma")),
    ("avx512", ("avx512f", "avx512bw", "avx512vl")),
    ("avx512_vnni", ("avx512_vnni",)),
    ("avx_vnni", ("avx_vnni",)),
    ("avx512_bf16", ("avx512_bf16",)),
    ("amx_bf16", ("amx_bf16", "amx_tile")),
    ("amx_int8", ("amx_int8", "amx_tile")),
)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one), at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, cores or 1)


@functools.cache
def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo; empty where there is none."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block ends at its first blank line
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The x86 feature flags of this CPU (/proc/cpuinfo), read once; empty where unknown (the
    learner's GEMM dispatch asks on every call)."""
    return frozenset(_cpuinfo().get("flags", "").split())


def cpu_vendor() -> str:
    """The CPU's vendor_id ('GenuineIntel', 'AuthenticAMD', ...); '' where unknown."""
    return _cpuinfo().get("vendor_id", "")


def cpu_name() -> str:
    """The CPU's model name as `lscpu` prints it, else the machine."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


def isa_levels(flags: set[str] | None = None) -> list[str]:
    """The ISA levels of `LEVELS` this CPU has (`flags`, this CPU's when None), lowest first."""
    flags = cpu_flags() if flags is None else flags
    return [name for name, needs in LEVELS if all(f in flags for f in needs)]


# int8 dot products summed in int32 in one instruction (oneDNN's int8 GEMM uses them)
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def has_int8_dot(flags: set[str] | None = None) -> bool:
    """Whether this CPU (`flags`, this CPU's when None) has VNNI or AMX-INT8."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in INT8_DOT_FLAGS)


# bf16 arithmetic in hardware (dot products of bf16 pairs, or AMX tiles); without it torch
# runs bf16 GEMMs by conversion to fp32, slower than fp32 itself
BF16_MATH_FLAGS = ("avx512_bf16", "amx_bf16")


def has_bf16_math(flags: set[str] | None = None) -> bool:
    """Whether this CPU (`flags`, this CPU's when None) has AVX512-BF16 or AMX-BF16."""
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in BF16_MATH_FLAGS)


def has_amx_bf16(flags: set[str] | None = None) -> bool:
    """Whether this CPU (`flags`, this CPU's when None) has AMX tiles with bf16 arithmetic."""
    flags = cpu_flags() if flags is None else flags
    return {"amx_bf16", "amx_tile"} <= flags


def has_amx_int8(flags: set[str] | None = None) -> bool:
    """Whether this CPU (`flags`, this CPU's when None) has AMX tiles with int8 arithmetic."""
    flags = cpu_flags() if flags is None else flags
    return {"amx_int8", "amx_tile"} <= flags
