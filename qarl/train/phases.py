"""The phases of one RL step, each a function the loop in trainer.py calls in order.

rewards -> advantages -> old_logp -> update -> sync; generation is one engine call and needs
no wrapper. Every phase returns its metrics as a flat dict of floats keyed `group/name`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch
from torch import Tensor

from qarl.algo import LOSSES, apply_corrections, global_counts, group_advantages, overlong_penalty
from qarl.algo.common import metrics_to_floats
from qarl.tasks import Example, RewardResult
from qarl.train.learner import aligned_logprobs, replay_logprobs, response_logprobs
from qarl.train.optim import learning_rate, set_learning_rate
from qarl.types import RolloutBatch


class PhaseTimer:
    """Wall seconds per named phase: `with timer("generate"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}": v for k, v in self.seconds.items()}


def score_responses(
    run, examples: list[Example], batch: RolloutBatch, group_size: int
) -> tuple[RewardResult, list[str]]:
    """Decode each response and score it against its prompt (examples repeat per group);
    return the rewards and the decoded completions."""
    completions = [
        run.tokenizer.decode(ids[mask].tolist())
        for ids, mask in zip(batch.response_ids, batch.response_mask)
    ]
    calls = [
        (examples[i // group_size].prompt, text, examples[i // group_size].reward_kwargs())
        for i, text in enumerate(completions)
    ]
    return run.rewards.score(calls), completions


def reward_metrics(result: RewardResult) -> dict[str, float]:
    scored = [r for r in result.rewards if r is not None]
    n = max(1, len(result.rewards))
    metrics = {f"reward/{k}": v / n for k, v in result.counts.items()}
    metrics["reward/mean"] = sum(scored) / len(scored) if scored else float("nan")
    metrics["reward/accuracy"] = sum(r >= 1.0 for r in scored) / n
    return metrics


def compute_advantages(rewards: list[float | None], batch: RolloutBatch, algo, group_size: int):
    """Advantages [N] and the rows that take part in the update ([N] bool)."""
    values = torch.tensor([float("nan") if r is None else r for r in rewards])  # [N]
    if algo.overlong is not None:
        values = values + overlong_penalty(batch.response_lengths, algo.overlong.l_max,
                                           algo.overlong.l_cache)
    advantages, info = group_advantages(values, group_size, mode=algo.advantage)
    rows = info.keep if algo.dynamic_sampling else torch.ones_like(info.keep)
    metrics = {"groups/all_equal_frac": info.all_equal.float().mean().item(),
               "groups/kept_frac": rows.float().mean().item()}
    return advantages, rows, metrics


def loss_setup(cfg, batch: RolloutBatch, old_logp: Tensor, advantages: Tensor, rows: Tensor):
    """The step's rollout correction (computed once, on the whole batch, from old_logp) and
    the loss parameters, including the whole batch's token / sequence counts."""
    algo = cfg.algo
    mask = batch.response_mask & rows[:, None]  # [N, L] bool
    specs = {algo.correction: algo.correction_params} if algo.correction else {}
    correction = apply_corrections(specs, old_logp, batch.rollout_logp, mask, advantages, old_logp)
    # norm_len: the fixed length of seq-mean-token-sum-norm (Dr.GRPO), the response budget
    params = {"norm_len": cfg.rollout.max_new_tokens, **algo.loss_params}
    if algo.aggregation is not None:
        params["aggregation"] = algo.aggregation
    params.update(global_counts(algo.loss, old_logp, batch.rollout_logp, correction.mask, **params))
    return correction, params


def update_policy(run, optimizers, batch: RolloutBatch, old_logp: Tensor, advantages: Tensor,
                  rows: Tensor, step: int) -> dict[str, float]:
    """K epochs; each accumulates every micro-batch, then takes one optimizer step.

    The loss is aggregated with counts of the WHOLE batch (global_counts), so how the batch
    is split into micro-batches does not change the update. logp takes its value from the
    engine's decode path and its gradient from the fast forward (aligned_logprobs): in the
    first epoch that value is old_logp itself (the ratio is exactly 1); later epochs replay
    the whole batch once with the updated weights.
    """
    cfg, algo, train = run.config, run.config.algo, run.config.train
    correction, params = loss_setup(cfg, batch, old_logp, advantages, rows)
    loss_mask = correction.mask  # [N, L] float
    lr = learning_rate(step, train.steps, train.lr, train.min_lr, train.warmup_steps, train.lr_schedule)
    set_learning_rate(optimizers, lr)
    N, mb = batch.num_sequences, train.micro_batch_size
    totals: dict[str, float] = {}
    entropy_sum, entropy_count = 0.0, 0
    skipped = 0
    learner = run.learner
    learner.train()
    for epoch in range(algo.epochs):
        # logp's value always comes from the engine path, replayed on the WHOLE batch (the
        # shape it was sampled with: a micro-batch replay is not exact, and on smollm2 W8A8
        # the activation quantizers amplify that to ~0.1 nats). Epoch 0 is old_logp itself;
        # later epochs replay once with the updated weights (constant within an epoch).
        exact = old_logp if epoch == 0 else replay_logprobs(run.scorer, batch, run.sampling())
        for start in range(0, N, mb):
            idx = torch.arange(start, min(N, start + mb))
            sub = batch.select(idx)
            fast, entropy = response_logprobs(learner, sub, cfg.rollout.temperature)
            logp = aligned_logprobs(fast, exact[idx])
            loss, metrics = LOSSES[algo.loss](
                logp, old_logp[idx], sub.rollout_logp, advantages[idx], loss_mask[idx],
                is_weights=correction.weights[idx], **params,
            )
            loss.backward()
            share = len(idx) / N / algo.epochs
            for key, value in metrics_to_floats(metrics).items():
                totals[f"loss/{key}"] = totals.get(f"loss/{key}", 0.0) + share * value
            if epoch == 0:
                entropy_sum += float((entropy * sub.response_mask).sum())
                entropy_count += int(sub.response_mask.sum())
        grad_norm = clip_gradients(learner, train.grad_clip)
        # No learning signal (every group's rewards equal, or every row masked): skip the
        # step, or Adam's momentum alone would keep moving the weights.
        if grad_norm > 0:
            for opt in optimizers:
                opt.step()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        skipped += grad_norm == 0
    learner.eval()
    totals.update(metrics_to_floats({f"correction/{k}": v for k, v in correction.metrics.items()}))
    totals["policy/entropy"] = entropy_sum / max(1, entropy_count)
    totals["policy/grad_norm"] = grad_norm
    totals["policy/lr"] = lr
    totals["policy/skipped_steps"] = skipped
    return totals


def clip_gradients(model, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))
