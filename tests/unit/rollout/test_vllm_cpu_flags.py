"""`int8_gemm_saturates`: which CPUs run vLLM's oneDNN int8 GEMM with int16-saturating pair sums
(qarl/rollout/vllm_engine.py). Needs no vllm: the function reads CPU flags only."""

from qarl.rollout.vllm_support import int8_gemm_saturates


def test_saturates_exactly_on_x86_without_vnni():
    """x86 without VNNI / AMX-INT8 saturates (vpmaddubsw); any of avx512_vnni, avx_vnni or
    amx_int8 sums in int32 (vpdpbusd / AMX); non-x86 or unknown flags are never flagged."""
    avx2 = {"sse2", "avx", "avx2", "fma"}
    assert int8_gemm_saturates(avx2)
    assert int8_gemm_saturates(avx2 | {"avx512f", "avx512bw"})
    for vnni in ("avx512_vnni", "avx_vnni", "amx_int8"):
        assert not int8_gemm_saturates(avx2 | {vnni})
    assert not int8_gemm_saturates(set())
    assert not int8_gemm_saturates({"fp", "asimd", "asimddp"})  # aarch64 Features
