"""Checks of the train section that span sections or the machine: the master weights' dtype
against training, the logp path against the alignment mode, train.device against the
devices this machine has, and async rollouts against the engine (the `CHECKS` of
qarl.config.checks run them)."""

from __future__ import annotations

import re

from qarl.config.errors import Problem
from qarl.quant import SCHEMES


def masters_can_learn(model, train, sft) -> list[Problem]:
    """bfloat16 master weights only where nothing is trained (train.lr = 0, sft.steps = 0)."""
    if model.master_dtype != "bfloat16" or (train.lr == 0 and sft.steps == 0):
        return []
    return [Problem("model.master_dtype", "'bfloat16' master weights round small optimizer "
                    "updates away (lr 2e-5 AdamW on smollm2-135m: 3.4% of weights moved in 3 "
                    "steps and held-out accuracy fell), so the run would not learn. Keep "
                    "'float32' masters and set train.compute_dtype = 'bfloat16' for a bf16 "
                    "gradient pass ('auto' picks it on CUDA and CPUs with AMX-BF16); a run "
                    "that only evaluates may keep bfloat16 with train.lr = 0")]


def forward_logp_is_inexact_mode(train, quant) -> list[Problem]:
    """train.logp_path = 'forward' only with quant.align 'fake' or 'naive' and a quantized
    scheme: where the decode-path replay is exact, a teacher-forced forward would not be."""
    scheme = SCHEMES.get(quant.scheme)
    if train.logp_path != "forward" or scheme is None:
        return []
    if quant.align == "kernel" or scheme.is_identity:
        setting = ("quant.scheme = 'none'" if scheme.is_identity
                   else "quant.align = 'kernel'")
        return [Problem("train.logp_path", f"'forward' with {setting}: there the decode-path "
                        "replay equals the sampler's logprobs bit for bit (and is audited, not "
                        "run on every row), which a teacher-forced forward does not; keep "
                        "'decode', or use 'forward' with quant.align = 'fake' or 'naive'")]
    return []

def codes_backward_has_codes(train, quant) -> list[Problem]:
    """train.quant_backward = 'codes' only for a format with a backward on codes
    (`Scheme.codes_pass`) in a quantized learner (fake or kernel alignment)."""
    scheme = SCHEMES.get(quant.scheme)
    if train.quant_backward != "codes" or scheme is None:
        return []
    if scheme.codes_pass() is None:
        having = sorted(n for n, s in SCHEMES.items() if s.codes_pass() is not None)
        return [Problem("train.quant_backward", f"'codes' with quant.scheme = {quant.scheme!r}, "
                        f"which has no backward on codes; it needs one of {having}. Use "
                        "'float' or 'auto'")]
    if quant.align == "naive":
        return [Problem("train.quant_backward", "'codes' with quant.align = 'naive', whose "
                        "learner is full precision and has no codes; use quant.align = "
                        "'kernel' (or 'fake'), or quant_backward = 'auto'")]
    return []


DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?")


def device_exists(train, dist) -> list[Problem]:
    """train.device is 'cpu', 'cuda' or 'cuda:N' naming a CUDA device this machine has; with
    learner ranks (dist.learner_ranks > 1) it is 'cpu'."""
    device = train.device
    if not DEVICE_PATTERN.fullmatch(device):
        return [Problem("train.device", f"{device!r} is not a device qarl trains on; use "
                        "'cpu', 'cuda' or 'cuda:N'")]
    if device == "cpu":
        return []
    import torch

    if not torch.cuda.is_available():
        why = ("this torch is a CPU build" if torch.version.cuda is None
               else "no CUDA device is visible (CUDA_VISIBLE_DEVICES, driver)")
        return [Problem("train.device", f"{device!r}, but {why} (torch {torch.__version__}); "
                        "use 'cpu', or a machine with a GPU and a CUDA build of torch")]
    count, index = torch.cuda.device_count(), int(device.partition(":")[2] or 0)
    if index >= count:
        return [Problem("train.device", f"{device!r}, but this machine has {count} CUDA "
                        f"device(s): use one of cuda:0..cuda:{count - 1}")]
    if dist.learner_ranks > 1:
        return [Problem("train.device", f"{device!r} with dist.learner_ranks = "
                        f"{dist.learner_ranks}: learner ranks run on the CPU; use one rank "
                        "on the GPU or train.device = 'cpu'")]
    return []


def async_rollouts_fit(train, rollout, dist) -> list[Problem]:
    """train.async_rollouts generates in a background thread of this process: not with the
    vLLM engine in this process (its generate saves, moves and restores the process's global
    torch RNG, which the learner's thread uses at the same time; Ray rollout workers of it
    run vLLM in their own processes); train.async_staleness only with train.async_rollouts."""
    problems = []
    if train.async_rollouts and rollout.engine == "vllm" and dist.rollout_workers == 1:
        problems.append(Problem("train.async_rollouts", "true with rollout.engine = 'vllm' in "
                                "this process: vLLM's generate saves, draws from and restores "
                                "the process's global torch RNG, which the learner uses at the "
                                "same time in the other thread, so neither would be "
                                "reproducible; run vLLM in Ray rollout workers "
                                "(dist.rollout_workers > 1), use rollout.engine = 'local', or "
                                "set async_rollouts = false"))
    if not train.async_rollouts and train.async_staleness != 1:
        problems.append(Problem("train.async_staleness", f"{train.async_staleness} without "
                                "train.async_rollouts = true, where every batch is sampled by "
                                "the learner's current weights; set async_rollouts = true or "
                                "remove async_staleness"))
    return problems
