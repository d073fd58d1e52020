"""The learner's gradient-pass precision (recipe train.compute_dtype).

The value of every logp the losses see comes from the exact replay (or the sampler), never
from the gradient pass (`logprobs.aligned_logprobs`), so the gradient pass may run in a
cheaper dtype without moving old_logp, the ratio or the trust band: under bfloat16 its forward
runs under `torch.autocast` and the straight-through backward of every QuantLinear
(`qarl.quant.linear`) multiplies in bf16 with fp32 results. Master weights and optimizer
state stay in model.master_dtype (float32), which is what lets small AdamW updates land:
bf16 master weights round an lr-2e-5 update away (docs/training.md).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch

from qarl.native.isa import has_bf16_math


def resolve_compute_dtype(requested: str, device: torch.device) -> torch.dtype:
    """train.compute_dtype as a torch dtype on `device` ('auto': bf16 on CUDA, the mixed
    precision GPU trainers run; float32 on every CPU, bf16 arithmetic or not: on a CPU with
    AVX512-BF16 the bf16 gradient pass was ~10% faster per run but learned worse, default
    recipe held-out 0.79 / 0.97 / 0.95 vs 0.97 / 1.00 / 0.96 in fp32 over seeds 0-2,
    docs/training.md)."""
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[requested]


def gradient_pass(dtype: torch.dtype, device: torch.device) -> ContextManager:
    """The context the gradient forward runs in: autocast to `dtype`, or nothing for fp32."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def describe_compute(dtype: torch.dtype, requested: str) -> str:
    """One line for the run's start: what the gradient pass computes in, and why."""
    name = str(dtype).removeprefix("torch.")
    if requested != "auto":
        return f"{name} (train.compute_dtype = {requested!r})"
    if dtype == torch.bfloat16:
        why = "bf16 on CUDA"
    elif has_bf16_math():
        why = "fp32 on CPUs; 'bfloat16' is ~10% faster here and learns worse, docs/training.md"
    else:
        why = "fp32 on CPUs; this one has no bf16 arithmetic"
    return f"{name} (train.compute_dtype = 'auto': {why})"
