"""`QARL_VLLM_EMULATE_AMX=1` runs these tests with vLLM dispatching int8 layers as on an AMX
CPU (`qarl.rollout.vllm_support.emulate_amx_dispatch`), so one AVX-512 VNNI machine checks
both paths (`make test-vllm` does: once natively, once emulated). Where the emulation cannot
run (an AVX2 CPU; an AMX CPU, where the native pass already ran the real dispatch) the emulated
pass is skipped, saying why."""

from __future__ import annotations

import os

import pytest

EMULATE = os.environ.get("QARL_VLLM_EMULATE_AMX") == "1"

if EMULATE:
    from qarl.rollout.vllm_support import can_emulate_amx_dispatch, emulate_amx_dispatch

    if can_emulate_amx_dispatch():
        emulate_amx_dispatch()  # before any test module imports vllm
    else:
        EMULATE = None


def pytest_collection_modifyitems(config, items):
    if EMULATE is None:
        skip = pytest.mark.skip(reason="QARL_VLLM_EMULATE_AMX=1 needs an x86 CPU with AVX-512 "
                                "and VNNI and without AMX (an AMX CPU's own pass runs the real "
                                "dispatch; an AVX2 CPU cannot run vLLM's AVX512-BF16 build)")
        for item in items:
            item.add_marker(skip)
