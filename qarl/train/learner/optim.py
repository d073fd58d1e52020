"""Optimizers and the learning-rate schedule.

Muon is used as it normally is: on the 2-D weight matrices inside the transformer blocks;
embeddings, the output head, norms and biases stay on AdamW. `torch.optim.Muon` (torch >= 2.9)
is used as shipped, with `adjust_lr_fn="match_rms_adamw"` so one learning rate means the same
update size for both groups.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.graph import increment_version

from qarl.config.train_schema import OPTIMIZERS, SCHEDULES


def muon_parameter_names(model: nn.Module) -> list[str]:
    """Hidden 2-D matrices: every 2-D parameter under `model.layers` (not embed/lm_head)."""
    return [
        name for name, p in model.named_parameters()
        if p.requires_grad and p.ndim == 2 and ".layers." in f".{name}"
    ]


def build_optimizer(
    model: nn.Module, name: str, lr: float, weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
) -> list[torch.optim.Optimizer]:
    """One optimizer (adamw) or two (muon for hidden matrices + adamw for the rest)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {sorted(OPTIMIZERS)}")
    params = dict(model.named_parameters())
    trainable = {n: p for n, p in params.items() if p.requires_grad}
    if name == "adamw":
        return [_adamw(list(trainable.values()), lr, weight_decay, betas)]
    muon_names = set(muon_parameter_names(model))
    muon = torch.optim.Muon(
        [trainable[n] for n in sorted(muon_names)], lr=lr, weight_decay=weight_decay,
        adjust_lr_fn="match_rms_adamw",
    )
    rest = [p for n, p in trainable.items() if n not in muon_names]
    return [muon, _adamw(rest, lr, weight_decay, betas)]


def _adamw(params: list[nn.Parameter], lr: float, weight_decay: float,
           betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW, fused (one kernel over every tensor, far faster than the per-tensor loop:
    benchmarks/step_time.py times the update) where torch has the fused kernel for the
    parameters: plain fp32/bf16 tensors on CPU or CUDA. Sharded (FSDP) parameters keep the
    per-tensor loop."""
    fused = bool(params) and all(
        type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda")
        and p.dtype in (torch.float32, torch.bfloat16) for p in params)
    adamw = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas,
                              fused=fused or None)
    if fused:
        # The fused kernel writes the parameters without bumping their version counters, which
        # is how every QuantLinear knows its quantized weight is stale (qarl/quant/linear.py):
        # the learner's replay would run the old codes while the engine got new ones (the
        # replay audit flags that at the first audited step).
        adamw.register_step_post_hook(lambda opt, args, kwargs: increment_version(
            [p for group in opt.param_groups for p in group["params"]]))
    return adamw


def learning_rate(step: int, total: int, lr: float, min_lr: float, warmup: int, schedule: str) -> float:
    """lr at `step` (0-based): linear warm-up to `lr`, then constant / cosine / linear to min_lr."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown lr_schedule {schedule!r}; valid: {sorted(SCHEDULES)}")
    if warmup and step < warmup:
        return lr * (step + 1) / warmup
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return lr + (min_lr - lr) * progress
    # cosine: min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_learning_rate(optimizers: list[torch.optim.Optimizer], lr: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr
