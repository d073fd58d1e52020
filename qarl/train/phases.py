"""The phases of one RL step (docs/training.md), called in order by `trainer.rl_step`.

prompts -> generate -> reward -> advantages -> old_logp -> update -> sync. Generation, the
old_logp replay, the update and the sync are one call each on the policy pair
(qarl.train.policy.Policy: its engine, its learner `qarl.train.learner.Learner`, its sync);
the other phases are here, each taking only what it needs, with the `Experience` the update
takes. Every phase's metrics are a flat dict of floats keyed `group/name`.
"""

from __future__ import annotations

import random
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from qarl.algo import group_advantages, kl_terms, overlong_penalty
from qarl.algo.diagnostics import error_token_metrics, mismatch_metrics, routing_disagreement
from qarl.config import AlgoSection
from qarl.model.tokenizer import Tokenizer
from qarl.tasks import Example, RewardResult, RewardRunner, Task
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
    sampling: SamplingParams  # what the learner scores them under (data.learner_view)
    old_logp: Tensor  # [N, L] float32, the learner's decode-path logprobs of the sampled tokens
    advantages: Tensor  # [N] float32
    rows: Tensor  # [N] bool, rows that take part in the update
    # MoE: the experts the learner's own routers chose in the old_logp replay, as
    # batch.routed_experts ([N, P + L, moe_layers, k] int16); None for a dense model
    learner_routing: Tensor | None = None
    # the rows a replay computed (qarl.train.learner.audit: all of them, or the audited ones where
    # old_logp is the sampler's by construction) [n] int64, and their replayed logprobs
    # [n, L] float32; None: every row, old_logp itself
    replayed_rows: Tensor | None = None
    replayed_logp: Tensor | None = None
    # the reference policy's logprobs of the sampled tokens [N, L] float32, where the KL term
    # is in the loss (algo.kl_coef > 0, algo.kl_in = 'loss'); None otherwise
    ref_logp: Tensor | None = None


def train_examples(task: Task, seed: int, step: int, num_prompts: int) -> list[Example]:
    """The prompts of `step`: a pure function of (seed, step), so a resumed run sees the same
    data it would have seen without the interruption."""
    step_seed = random.Random(f"{seed}:{step}").getrandbits(31)
    return task.examples("train", num_prompts, step_seed)


def reward_responses(
    tokenizer: Tokenizer, rewards: RewardRunner, examples: list[Example], batch: RolloutBatch,
    group_size: int,
) -> tuple[RewardResult, list[str]]:
    """Decode each response and reward it against its prompt (examples repeat per group);
    return the rewards and the decoded completions."""
    completions = [
        tokenizer.decode(ids[mask].tolist())
        for ids, mask in zip(batch.response_ids, batch.response_mask)
    ]
    calls = [
        (examples[i // group_size].prompt, text, examples[i // group_size].reward_kwargs())
        for i, text in enumerate(completions)
    ]
    return rewards.score(calls), completions


def reward_metrics(result: RewardResult) -> dict[str, float]:
    scored = [r for r in result.rewards if r is not None]
    n = max(1, len(result.rewards))
    metrics = {f"reward/{k}": v / n for k, v in result.counts.items()}
    metrics["reward/mean"] = sum(scored) / len(scored) if scored else float("nan")
    metrics["reward/accuracy"] = sum(r >= 1.0 for r in scored) / n
    metrics["reward/workers_replaced"] = float(result.workers_replaced)
    return metrics


def compute_advantages(rewards: list[float | None], batch: RolloutBatch, algo: AlgoSection,
                       group_size: int, penalty: Tensor | None = None,
                       ) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Advantages [N] and the rows that take part in the update ([N] bool). `penalty` [N]:
    subtracted from each reward first (the KL in the reward, `reference_kl`)."""
    values = torch.tensor([float("nan") if r is None else r for r in rewards],
                          dtype=torch.float64,  # [N] float64: group statistics in float64
                          device=batch.response_ids.device)
    if penalty is not None:
        values = values - penalty.to(values)  # an unscorable reward stays NaN
    if algo.overlong is not None:
        values = values + overlong_penalty(batch.response_lengths, algo.overlong.l_max,
                                           algo.overlong.l_cache)
    # lengths weight the REINFORCE++ modes' batch statistics by response tokens;
    # drop_all_equal keeps their statistics to the rows dynamic sampling keeps
    advantages, info = group_advantages(values, group_size, mode=algo.advantage,
                                        lengths=batch.response_lengths,
                                        drop_all_equal=algo.dynamic_sampling)
    rows = info.keep if algo.dynamic_sampling else torch.ones_like(info.keep)
    metrics = {"groups/all_equal_frac": info.all_equal.float().mean().item(),
               "groups/kept_frac": rows.float().mean().item()}
    return advantages, rows, metrics


def reference_kl(algo: AlgoSection, old_logp: Tensor, ref_logp: Tensor,
                 mask: Tensor) -> tuple[Tensor | None, dict[str, float]]:
    """The KL of the sampling policy (old_logp) against the reference per token
    (algo.kl_estimator), as metrics, and, where it goes into the reward (algo.kl_in =
    'reward'), each response's penalty kl_coef x sum_t kl_t ([N] float64; None otherwise)."""
    kl = kl_terms(old_logp, ref_logp, mask, estimator=algo.kl_estimator)  # [N, L]
    tokens = max(1, int(mask.sum()))
    metrics = {"kl/token_mean": float(kl.sum()) / tokens,
               "kl/seq_sum_mean": float(kl.sum()) / max(1, kl.shape[0])}
    if algo.kl_in != "reward":
        return None, metrics
    penalty = algo.kl_coef * kl.sum(dim=1).double()  # [N]
    metrics["kl/reward_penalty_mean"] = float(penalty.mean())
    return penalty, metrics


def sample_metrics(task: Task, exp: Experience, completions: list[str]) -> dict[str, float]:
    """Learner-vs-sampler mismatch (over the replayed rows) and error-token rates of the
    step's samples."""
    batch = exp.batch
    grammar = getattr(task, "grammar_ok", None)
    verdicts = [grammar(c) for c in completions] if grammar else None
    # over the rows a replay computed: where old_logp is the sampler's logprobs by
    # construction, the audited rows (the others would show a mismatch of 0 by definition)
    rows = exp.replayed_rows if exp.replayed_rows is not None else slice(None)
    replayed = exp.replayed_logp if exp.replayed_logp is not None else exp.old_logp
    mismatch = mismatch_metrics(replayed, batch.rollout_logp[rows], batch.response_mask[rows])
    errors = error_token_metrics(batch.response_ids, batch.response_mask, batch.finish_reasons,
                                 learner_logp=exp.old_logp, grammar_ok=verdicts)
    if batch.routed_experts is not None and exp.learner_routing is not None:
        mismatch.update(routing_disagreement(exp.learner_routing, batch.routed_experts,
                                             batch.response_mask))
    return {**{f"mismatch/{k}": v for k, v in mismatch.items()},
            **{f"errors/{k}": v for k, v in errors.items()}}
