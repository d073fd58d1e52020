"""The learner's update: `algo.epochs` epochs of micro-batched backward passes, each ended by
one optimizer step, with the guards. `Learner.update` runs it (qarl.train.learner.learner).

One function serves every learner. What differs between one process and learner ranks is
only which micro-batches a rank computes and how sums cross ranks, and that is a
`Collectives` object: `SOLO` (a world of one: every micro-batch, identities) here,
`qarl.parallel.ranks.RankGroup` (collectives) on ranks. So the update reads the same on one
process and on M ranks.

The loss is aggregated with counts of the WHOLE batch (`global_counts`), so how the batch is
split into micro-batches (or ranks) does not change the update. logp takes its value from
the value pass and its gradient from the gradient forward (`aligned_logprobs`), both owned by
the learner's `Passes` (qarl.train.learner.passes), which also says where a later optimizer
step's value comes from. Guards: no advantage to learn from (every one 0) is a no-op
(`guard/no_signal`); a non-finite loss, gradient or optimizer setting drops the epoch's step
and ends the update (`guard/nonfinite`): weights and optimizer state stay as they were; a
step that leaves weights non-finite all the same raises `NonFiniteWeights`.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import Tensor

from qarl.algo import (
    LOSSES, Correction, apply_corrections, global_counts, kl_terms, metrics_to_floats,
)
from qarl.config import AlgoSection, TrainSection
from qarl.train.guards import check_weights, settings_finite
from qarl.train.learner.logprobs import aligned_logprobs
from qarl.train.learner.optim import learning_rate, set_learning_rate
from qarl.train.learner.passes import Passes
from qarl.train.phases import Experience


class Collectives(Protocol):
    """How one update's work and sums are shared among learner ranks."""

    lockstep: bool  # every rank must run every backward (FSDP: backward is a collective)

    def micro_batches(self, starts: range) -> range: ...
    def sum_gradients(self, model: torch.nn.Module) -> None: ...
    def all_true(self, flag: bool) -> bool: ...
    def sum_floats(self, values: list[float]) -> list[float]: ...
    def sum_metrics(self, totals: dict[str, float]) -> dict[str, float]: ...
    def clip_gradients(self, params: list[Tensor], max_norm: float) -> float: ...
    def local(self, tensor: Tensor) -> Tensor: ...


class _Solo:
    """A world of one: this process computes every micro-batch; every sum is its own."""

    lockstep = False

    def micro_batches(self, starts: range) -> range:
        return starts

    def sum_gradients(self, model: torch.nn.Module) -> None:
        pass

    def all_true(self, flag: bool) -> bool:
        return flag

    def sum_floats(self, values: list[float]) -> list[float]:
        return values

    def sum_metrics(self, totals: dict[str, float]) -> dict[str, float]:
        return totals

    def clip_gradients(self, params: list[Tensor], max_norm: float) -> float:
        if max_norm > 0:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])))

    def local(self, tensor: Tensor) -> Tensor:
        return tensor


SOLO = _Solo()


def loss_setup(algo: AlgoSection, exp: Experience) -> tuple[Correction, dict]:
    """The step's rollout correction (computed once, on the whole batch, from old_logp) and
    the loss parameters, less the token / sequence counts (`step_counts`)."""
    batch, old_logp = exp.batch, exp.old_logp
    mask = batch.response_mask & exp.rows[:, None]  # [N, L] bool
    specs = {algo.correction: algo.correction_params} if algo.correction else {}
    correction = apply_corrections(specs, old_logp, batch.rollout_logp, mask, exp.advantages, old_logp)
    # norm_len: the fixed length of seq-mean-token-sum-norm (Dr.GRPO), the response budget
    params = {"norm_len": exp.sampling.max_new_tokens, **algo.loss_params}
    if algo.aggregation is not None:
        params["aggregation"] = algo.aggregation
    return correction, params


def step_counts(algo: AlgoSection, exp: Experience, correction: Correction, params: dict,
                rows: range) -> dict:
    """The token / sequence counts one optimizer step's loss aggregates over: those of its
    mini-batch `rows` (the whole batch when there is one mini-batch), so that how the rows
    are split into micro-batches or ranks does not change the step."""
    part = slice(rows.start, rows.stop)
    return global_counts(algo.loss, exp.old_logp[part], exp.batch.rollout_logp[part],
                         correction.mask[part], **params)


def mini_batches(n: int, parts: int) -> list[range]:
    """The rows of each optimizer step of an epoch: `parts` consecutive equal ranges of the
    batch's n rows, in order (the config checks make n a multiple of parts x micro-batch)."""
    size = n // parts
    return [range(j * size, (j + 1) * size) for j in range(parts)]


def update_policy(passes: Passes, optimizers: list[torch.optim.Optimizer], group: Collectives,
                  exp: Experience, algo: AlgoSection, train: TrainSection,
                  step: int) -> dict[str, float]:
    """Train `passes.model` with `optimizers` on `exp` (module docstring): `algo.epochs` passes
    over the batch, each `train.mini_batches` optimizer steps on consecutive parts of its rows.
    logp's value at the first optimizer step is exp.old_logp (the learner is still the policy
    old_logp came from); at every later one `passes.later` (the value pass with the weights
    the steps before it left, or the gradient forward's own). The first micro-batch's gradient
    forward may already have run (`passes.take_ahead`)."""
    lr = learning_rate(step, train.steps, train.lr, train.min_lr, train.warmup_steps, train.lr_schedule)
    ahead = passes.take_ahead(exp.batch)
    if not bool(exp.advantages[exp.rows].any()) and exp.ref_logp is None:
        # Every loss is advantage-weighted: its gradient is exactly 0, so nothing to compute
        # (a KL term in the loss still pulls towards the reference).
        return {"policy/lr": lr, "guard/no_signal": 1.0, "guard/nonfinite": 0.0,
                "policy/skipped_steps": 0.0}
    correction, params = loss_setup(algo, exp)
    module = passes.model
    set_learning_rate(optimizers, lr)
    totals: dict[str, float] = {"guard/no_signal": 0.0, "guard/nonfinite": 0.0}
    skipped = steps = 0
    grad_norms: list[float] = []  # of the steps whose backward ran
    entropy_total, entropy_tokens = 0.0, 0  # over the first epoch's response tokens
    parts = mini_batches(exp.batch.num_sequences, train.mini_batches)
    counts = {rows: step_counts(algo, exp, correction, params, rows) for rows in parts}
    kl = None if exp.ref_logp is None else {rows: kl_tokens(exp, rows) for rows in parts}
    module.train()
    with passes.checkpointed():
        for epoch, rows in ((e, r) for e in range(algo.epochs) for r in parts):
            values = exp.old_logp if steps == 0 else passes.later(exp, rows)
            steps += 1
            entropy_sum, entropy_count, finite = accumulate_gradients(
                passes, exp, values, algo, correction, {**params, **counts[rows]}, rows, group,
                totals, ahead if steps == 1 else None, None if kl is None else kl[rows])
            finite = group.all_true(finite)
            group.sum_gradients(module)
            entropy_sum, entropy_count = group.sum_floats([entropy_sum, entropy_count])
            if epoch == 0:
                entropy_total += entropy_sum
                entropy_tokens += entropy_count
            grad_norm, outcome = optimizer_step(module, optimizers, train.grad_clip, finite,
                                                group)
            grad_norms.append(grad_norm)
            skipped += outcome == "zero"
            if outcome == "nonfinite":
                totals["guard/nonfinite"] = 1.0
                break
    module.eval()
    totals["policy/entropy"] = entropy_total / max(1, entropy_tokens)
    totals["policy/optimizer_steps"] = float(steps - skipped - totals["guard/nonfinite"])
    totals = {**group.sum_metrics({k: v for k, v in totals.items() if k.startswith("loss/")}),
              **{k: v for k, v in totals.items() if not k.startswith("loss/")}}
    if "loss/kl_term" in totals:  # |KL term| / (|policy term| + |KL term|)
        kl_size, policy_size = abs(totals["loss/kl_term"]), abs(totals["loss/policy_term"])
        totals["loss/kl_share"] = kl_size / max(1e-12, kl_size + policy_size)
    totals.update(metrics_to_floats({f"correction/{k}": v for k, v in correction.metrics.items()}))
    totals["policy/grad_norm"] = sum(grad_norms) / len(grad_norms)  # mean over the steps
    totals["policy/lr"] = lr
    totals["policy/skipped_steps"] = skipped
    return totals


def kl_tokens(exp: Experience, rows: range) -> int:
    """The response tokens of the rows taking part in mini-batch `rows`: what the KL term's
    token mean divides by, on every rank and micro-batch alike."""
    part = slice(rows.start, rows.stop)
    return max(1, int((exp.batch.response_mask[part] & exp.rows[part, None]).sum()))


def accumulate_gradients(passes: Passes, exp: Experience, values: Tensor | None,
                         algo: AlgoSection, correction: Correction, params: dict, rows: range,
                         group: Collectives, totals: dict[str, float],
                         ahead: tuple[Tensor, Tensor] | None = None,
                         kl_count: int | None = None) -> tuple[float, int, bool]:
    """One optimizer step's backward passes over this rank's micro-batches of `rows` (its
    mini-batch); adds each loss metric (weighted by its share of the rows and epochs) to
    `totals`. Returns (entropy sum, response tokens, every loss finite); stops at the first
    non-finite loss, except where every rank must run every backward (`group.lockstep`: the
    step is dropped all the same). logp's value is `values`' (None: the gradient forward's
    own). `ahead`: the first micro-batch's gradient forward, already run. With a reference
    (exp.ref_logp), each micro-batch's loss adds algo.kl_coef x its share of the mini-batch's
    token-mean KL (`kl_count` tokens): sum_t kl_t / kl_count over its participating rows."""
    batch, N = exp.batch, exp.batch.num_sequences
    device = exp.old_logp.device
    size = passes.micro_batch_size
    entropy_sum, entropy_count, finite = 0.0, 0, True
    for start in group.micro_batches(range(rows.start, rows.stop, size)):
        idx = torch.arange(start, min(rows.stop, start + size), device=device)
        sub = batch.select(idx)
        if ahead is not None and start == rows.start:
            fast, entropy = ahead
        else:
            fast, entropy = passes.gradient(sub, exp.sampling.temperature)
        # value: values (the value pass's); gradient: fast
        logp = fast if values is None else aligned_logprobs(fast, values[idx])
        loss, metrics = LOSSES[algo.loss](
            logp, exp.old_logp[idx], sub.rollout_logp, exp.advantages[idx], correction.mask[idx],
            is_weights=correction.weights[idx], **params,
        )
        share = len(idx) / N / algo.epochs
        if exp.ref_logp is not None:
            # KL term: kl_coef x (1 / T_mini) sum_{participating tokens} kl(logp, ref_logp)
            valid = sub.response_mask & exp.rows[idx, None]
            kl = kl_terms(logp, exp.ref_logp[idx], valid, estimator=algo.kl_estimator)
            kl_term = algo.kl_coef * kl.sum() / kl_count
            # per optimizer step, each term is the sum over its micro-batches (and ranks);
            # the metrics are their means over the update's optimizer steps
            steps = algo.epochs * N // (rows.stop - rows.start)
            totals["loss/policy_term"] = totals.get("loss/policy_term", 0.0) + float(loss.detach()) / steps
            totals["loss/kl_term"] = totals.get("loss/kl_term", 0.0) + float(kl_term.detach()) / steps
            loss = loss + kl_term
        for key, value in metrics_to_floats(metrics).items():
            totals[f"loss/{key}"] = totals.get(f"loss/{key}", 0.0) + share * value
        if not bool(torch.isfinite(loss)):
            if not group.lockstep:
                return entropy_sum, entropy_count, False
            finite = False
        loss.backward()
        entropy_sum += float((entropy * sub.response_mask).sum())
        entropy_count += int(sub.response_mask.sum())
    return entropy_sum, entropy_count, finite


def optimizer_step(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                   grad_clip: float, loss_finite: bool = True,
                   group: Collectives = SOLO) -> tuple[float, str]:
    """Clip, step and clear the gradients; return the gradient norm before clipping and what
    happened: "stepped"; "nonfinite" (a loss, the gradient or a number of the optimizer's
    settings, e.g. the learning rate, was not finite: no step, the weights and the optimizer's
    moments stay as they were); "zero" (no learning signal, e.g. every row masked: no step, or
    Adam's momentum alone would keep moving the weights). A step that leaves a weight
    non-finite all the same raises NonFiniteWeights before the weights go anywhere."""
    params = [p for p in module.parameters() if p.grad is not None]
    grad_norm = group.clip_gradients(params, grad_clip) if params else 0.0
    if not loss_finite or not math.isfinite(grad_norm) or not settings_finite(optimizers):
        outcome = "nonfinite"
    elif grad_norm == 0:
        outcome = "zero"
    else:
        outcome = "stepped"
        for opt in optimizers:
            opt.step()
        check_weights([(n, group.local(p)) for n, p in module.named_parameters()])
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    return grad_norm, outcome
