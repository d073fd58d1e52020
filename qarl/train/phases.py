"""The phases of one RL step (docs/training.md), called in order by `trainer.rl_step`.

prompts -> generate -> reward -> advantages -> old_logp -> update -> sync. Generation, the
old_logp replay and the sync are one call each on the policy pair (qarl.train.setup.Policy);
the other phases are here, each taking only what it needs. Every phase's metrics are a flat
dict of floats keyed `group/name`.
"""

from __future__ import annotations

import math
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from qarl.algo import (
    LOSSES, Correction, apply_corrections, global_counts, group_advantages, metrics_to_floats,
    overlong_penalty,
)
from qarl.algo.diagnostics import error_token_metrics, mismatch_metrics, routing_disagreement
from qarl.config import AlgoSection, TrainSection
from qarl.tasks import Example, RewardResult, Task
from qarl.train.guards import check_weights, settings_finite
from qarl.train.learner import aligned_logprobs, response_logprobs
from qarl.train.optim import learning_rate, set_learning_rate
from qarl.train.setup import Data, Policy
from qarl.types import RolloutBatch, SamplingParams


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


@dataclass
class Experience:
    """One step's samples with everything the update needs (N = prompts x group_size rows)."""

    batch: RolloutBatch  # the engine's samples; rollout_logp [N, L] float32
    sampling: SamplingParams  # what the engine sampled them with
    old_logp: Tensor  # [N, L] float32, the learner's decode-path replay of the sampled tokens
    advantages: Tensor  # [N] float32
    rows: Tensor  # [N] bool, rows that take part in the update
    # MoE: the experts the learner's own routers chose in the old_logp replay, as
    # batch.routed_experts ([N, P + L, moe_layers, k] int16); None for a dense model
    learner_routing: Tensor | None = None


def train_examples(task: Task, seed: int, step: int, num_prompts: int) -> list[Example]:
    """The prompts of `step`: a pure function of (seed, step), so a resumed run sees the same
    data it would have seen without the interruption."""
    step_seed = random.Random(f"{seed}:{step}").getrandbits(31)
    return task.examples("train", num_prompts, step_seed)


def score_responses(
    data: Data, examples: list[Example], batch: RolloutBatch, group_size: int
) -> tuple[RewardResult, list[str]]:
    """Decode each response and score it against its prompt (examples repeat per group);
    return the rewards and the decoded completions."""
    completions = [
        data.tokenizer.decode(ids[mask].tolist())
        for ids, mask in zip(batch.response_ids, batch.response_mask)
    ]
    calls = [
        (examples[i // group_size].prompt, text, examples[i // group_size].reward_kwargs())
        for i, text in enumerate(completions)
    ]
    return data.rewards.score(calls), completions


def reward_metrics(result: RewardResult) -> dict[str, float]:
    scored = [r for r in result.rewards if r is not None]
    n = max(1, len(result.rewards))
    metrics = {f"reward/{k}": v / n for k, v in result.counts.items()}
    metrics["reward/mean"] = sum(scored) / len(scored) if scored else float("nan")
    metrics["reward/accuracy"] = sum(r >= 1.0 for r in scored) / n
    metrics["reward/workers_replaced"] = float(result.workers_replaced)
    return metrics


def compute_advantages(rewards: list[float | None], batch: RolloutBatch, algo: AlgoSection,
                       group_size: int) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Advantages [N] and the rows that take part in the update ([N] bool)."""
    values = torch.tensor([float("nan") if r is None else r for r in rewards],
                          dtype=torch.float64)  # [N] float64: group statistics in float64
    if algo.overlong is not None:
        values = values + overlong_penalty(batch.response_lengths, algo.overlong.l_max,
                                           algo.overlong.l_cache)
    advantages, info = group_advantages(values, group_size, mode=algo.advantage)
    rows = info.keep if algo.dynamic_sampling else torch.ones_like(info.keep)
    metrics = {"groups/all_equal_frac": info.all_equal.float().mean().item(),
               "groups/kept_frac": rows.float().mean().item()}
    return advantages, rows, metrics


def loss_setup(algo: AlgoSection, exp: Experience) -> tuple[Correction, dict]:
    """The step's rollout correction (computed once, on the whole batch, from old_logp) and
    the loss parameters, including the whole batch's token / sequence counts."""
    batch, old_logp = exp.batch, exp.old_logp
    mask = batch.response_mask & exp.rows[:, None]  # [N, L] bool
    specs = {algo.correction: algo.correction_params} if algo.correction else {}
    correction = apply_corrections(specs, old_logp, batch.rollout_logp, mask, exp.advantages, old_logp)
    # norm_len: the fixed length of seq-mean-token-sum-norm (Dr.GRPO), the response budget
    params = {"norm_len": exp.sampling.max_new_tokens, **algo.loss_params}
    if algo.aggregation is not None:
        params["aggregation"] = algo.aggregation
    params.update(global_counts(algo.loss, old_logp, batch.rollout_logp, correction.mask, **params))
    return correction, params


def update_policy(policy: Policy, optimizers: list[torch.optim.Optimizer], exp: Experience,
                  algo: AlgoSection, train: TrainSection, step: int) -> dict[str, float]:
    """`algo.epochs` epochs; each accumulates every micro-batch, then takes one optimizer step.

    The loss is aggregated with counts of the WHOLE batch (global_counts), so how the batch
    is split into micro-batches does not change the update. logp takes its value from the
    engine's decode path and its gradient from the fast forward (aligned_logprobs).
    Guards: no advantage to learn from (every one 0) is a no-op (`guard/no_signal`); a
    non-finite loss or gradient drops the epoch's step and ends the update
    (`guard/nonfinite`): weights and optimizer state stay as they were.
    With learner ranks (`policy.ranks`, a `qarl.train.ranks.RankGroup`; every rank calls this
    with the same `exp`) this rank computes its share of the micro-batches; gradients, the
    finite flag and the metrics are summed over the ranks before the optimizer step.
    """
    group = policy.ranks
    lr = learning_rate(step, train.steps, train.lr, train.min_lr, train.warmup_steps, train.lr_schedule)
    if not bool(exp.advantages[exp.rows].any()):
        # Every loss is advantage-weighted: its gradient is exactly 0, so nothing to compute.
        return {"policy/lr": lr, "guard/no_signal": 1.0, "guard/nonfinite": 0.0,
                "policy/skipped_steps": 0.0}
    correction, params = loss_setup(algo, exp)
    set_learning_rate(optimizers, lr)
    totals: dict[str, float] = {"guard/no_signal": 0.0, "guard/nonfinite": 0.0}
    skipped = 0
    policy.learner.train()
    for epoch in range(algo.epochs):
        # logp's value always comes from a decode-path replay of the WHOLE batch (the shape it
        # was sampled with: a micro-batch replay is not exact, and on smollm2 W8A8 the
        # activation quantizers amplify that to ~0.1 nats). In epoch 0 the learner is still
        # the policy that old_logp replayed; later epochs replay once with the updated weights.
        exact = exp.old_logp if epoch == 0 else policy.replay(exp.batch, exp.sampling)
        entropy_sum, entropy_count, finite = accumulate_gradients(
            policy.learner, exp, exact, algo, correction, params, train.micro_batch_size, totals,
            group, routing_replay=policy.routing_replay)
        if group is not None:
            finite = group.all_true(finite)
            group.sum_gradients(policy.learner)
            entropy_sum, entropy_count = group.sum_floats([entropy_sum, entropy_count])
        if epoch == 0:
            totals["policy/entropy"] = entropy_sum / max(1, entropy_count)
        grad_norm, outcome = optimizer_step(policy.learner, optimizers, train.grad_clip, finite)
        skipped += outcome == "zero"
        if outcome == "nonfinite":
            totals["guard/nonfinite"] = 1.0
            break
    policy.learner.eval()
    if group is not None:
        totals = {**group.sum_metrics({k: v for k, v in totals.items() if k.startswith("loss/")}),
                  **{k: v for k, v in totals.items() if not k.startswith("loss/")}}
    totals.update(metrics_to_floats({f"correction/{k}": v for k, v in correction.metrics.items()}))
    totals["policy/grad_norm"] = grad_norm
    totals["policy/lr"] = lr
    totals["policy/skipped_steps"] = skipped
    return totals


def accumulate_gradients(learner, exp: Experience, exact: Tensor, algo: AlgoSection,
                         correction: Correction, params: dict, micro_batch_size: int,
                         totals: dict[str, float], group=None, routing_replay: bool = False
                         ) -> tuple[float, int, bool]:
    """One epoch's backward passes, micro-batch by micro-batch (with a rank `group`, this
    rank's share of them); adds each loss metric (weighted by its share of the rows and
    epochs) to `totals`. Returns (entropy sum, response tokens, every loss finite); stops at
    the first non-finite loss, except where every rank must run every backward (FSDP ranks,
    `group.lockstep`: the epoch's step is dropped all the same)."""
    batch, N = exp.batch, exp.batch.num_sequences
    entropy_sum, entropy_count, finite = 0.0, 0, True
    starts = range(0, N, micro_batch_size)
    for start in starts if group is None else group.micro_batches(starts):
        idx = torch.arange(start, min(N, start + micro_batch_size))
        sub = batch.select(idx)
        fast, entropy = response_logprobs(learner, sub, exp.sampling.temperature,
                                          routing_replay=routing_replay)
        logp = aligned_logprobs(fast, exact[idx])  # value: exact; gradient: fast
        loss, metrics = LOSSES[algo.loss](
            logp, exp.old_logp[idx], sub.rollout_logp, exp.advantages[idx], correction.mask[idx],
            is_weights=correction.weights[idx], **params,
        )
        share = len(idx) / N / algo.epochs
        for key, value in metrics_to_floats(metrics).items():
            totals[f"loss/{key}"] = totals.get(f"loss/{key}", 0.0) + share * value
        if not bool(torch.isfinite(loss)):
            if group is None or not group.lockstep:
                return entropy_sum, entropy_count, False
            finite = False
        loss.backward()
        entropy_sum += float((entropy * sub.response_mask).sum())
        entropy_count += int(sub.response_mask.sum())
    return entropy_sum, entropy_count, finite


def optimizer_step(learner, optimizers: list[torch.optim.Optimizer], grad_clip: float,
                   loss_finite: bool = True) -> tuple[float, str]:
    """Clip, step and clear the gradients; return the gradient norm before clipping and what
    happened: "stepped"; "nonfinite" (a loss, the gradient or a number of the optimizer's
    settings, e.g. the learning rate, was not finite: no step, the weights and the optimizer's
    moments stay as they were); "zero" (no learning signal, e.g. every row masked: no step, or
    Adam's momentum alone would keep moving the weights). A step that leaves a weight
    non-finite all the same raises NonFiniteWeights before the weights go anywhere."""
    grad_norm = clip_gradients(learner, grad_clip)
    if not loss_finite or not math.isfinite(grad_norm) or not settings_finite(optimizers):
        outcome = "nonfinite"
    elif grad_norm == 0:
        outcome = "zero"
    else:
        outcome = "stepped"
        for opt in optimizers:
            opt.step()
        check_weights(learner)
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return grad_norm, outcome


def clip_gradients(model, max_norm: float) -> float:
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return 0.0
    if max_norm > 0:
        return _full_float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    if isinstance(params[0].grad, DTensor):  # FSDP shards: the norm needs their collective
        return _full_float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))


def _full_float(norm: Tensor) -> float:
    """A norm as a float; an FSDP gradient norm is a DTensor: its full value."""
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def sample_metrics(task: Task, exp: Experience, completions: list[str]) -> dict[str, float]:
    """Learner-vs-sampler mismatch and error-token rates of the step's samples."""
    batch = exp.batch
    grammar = getattr(task, "grammar_ok", None)
    verdicts = [grammar(c) for c in completions] if grammar else None
    mismatch = mismatch_metrics(exp.old_logp, batch.rollout_logp, batch.response_mask)
    errors = error_token_metrics(batch.response_ids, batch.response_mask, batch.finish_reasons,
                                 learner_logp=exp.old_logp, grammar_ok=verdicts)
    if batch.routed_experts is not None and exp.learner_routing is not None:
        mismatch.update(routing_disagreement(exp.learner_routing, batch.routed_experts,
                                             batch.response_mask))
    return {**{f"mismatch/{k}": v for k, v in mismatch.items()},
            **{f"errors/{k}": v for k, v in errors.items()}}
