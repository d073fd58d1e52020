"""What vLLM runs on which CPU (qarl.rollout.vllm_support), decided without vllm installed."""

from __future__ import annotations

import pytest
import torch

from qarl.native.isa import isa_levels
from qarl.rollout import vllm_support as vs


def test_auto_dtype_follows_the_int8_kernel_and_the_master():
    """auto = float32 unless the master is bfloat16 or an int8 layer's kernel needs 16-bit
    activations; an explicit dtype is kept; an unknown one raises naming the valid ones."""
    assert vs.resolve_dtype("auto", "float32", int8_needs_16bit=False) == "float32"
    assert vs.resolve_dtype("auto", "float32", int8_needs_16bit=True) == "bfloat16"
    assert vs.resolve_dtype("auto", "bfloat16", int8_needs_16bit=False) == "bfloat16"
    assert vs.resolve_dtype("bfloat16", "float32", int8_needs_16bit=False) == "bfloat16"
    assert vs.resolve_dtype("float32", "float32", int8_needs_16bit=True) == "float32"
    with pytest.raises(ValueError, match="'auto', 'float32', 'bfloat16'"):
        vs.resolve_dtype("float16", "float32", int8_needs_16bit=False)


def test_the_int8_kernel_named_per_cpu_kind(monkeypatch):
    """AMX -> the 16-bit AMX kernel; otherwise oneDNN, exact with VNNI, saturating without."""
    monkeypatch.setattr(vs, "is_x86", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert vs.int8_needs_16bit() and vs.int8_cpu_kernel() == vs.KERNEL_AMX
    assert vs.dtype_problem("float32", "w8a8-int8") == vs.FLOAT32_ON_AMX
    assert vs.dtype_problem("bfloat16", "w8a8-int8") is None
    assert vs.dtype_problem("float32", "none") is None
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    avx2 = {"sse2", "avx2", "fma"}
    assert vs.int8_cpu_kernel(avx2) == vs.KERNEL_ONEDNN_SATURATING
    assert vs.int8_cpu_kernel(avx2 | {"avx512f", "avx512_vnni"}) == vs.KERNEL_ONEDNN_VNNI
    assert vs.dtype_problem("float32", "w8a8-int8") is None


def test_isa_levels_of_the_three_machine_kinds():
    """The ISA levels benchmarks record, for the flags of each kind of machine qarl runs on."""
    zen3 = {"sse2", "avx2", "fma"}
    xeon = zen3 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    amx = xeon | {"avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
    assert isa_levels(zen3) == ["avx2"]
    assert isa_levels(xeon) == ["avx2", "avx512", "avx512_vnni"]
    assert isa_levels(amx) == ["avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx_bf16",
                               "amx_int8"]
