"""`Passes`: the learner's passes over a rollout batch, and which one gives logp's value when.

logp's value and logp's gradient come from different passes (`logprobs.aligned_logprobs`):

- the value pass (`replayer`): the engine's own decode path replayed around the learner (a
  LocalEngine: exact on CPU, so old_logp equals the sampler's logprobs bit for bit under
  `kernel` alignment), or under `train.logp_path = 'forward'` the learner's teacher-forced
  forward without grad (a `logprobs.ForwardScorer`);
- the gradient pass (`gradient`): the teacher-forced forward of one micro-batch with grad,
  in the run's `Precision`, its layers checkpointed where train.gradient_checkpointing.

At an update's first optimizer step logp's value is old_logp (the weights have not moved).
At a later one (several mini-batches or epochs: `later`) it is the value pass again with the
weights the steps before it left: the whole batch's replay (the shape it was sampled with: a
micro-batch replay is not exact), or the forward scorer's micro-batches that hold the step's
rows. Where the gradient forward computes the scorer's bits (`own_values`: an fp32 pass split
as the scorer splits, no LoRA) a later step reads its own forward's value instead, as TRL does.

The forward run ahead (`reads_ahead`): where a one-process learner's values are its own
gradient forward's, the old_logp phase of a step whose update follows (`replay(...,
for_update=True)`) runs the update's first micro-batch's gradient forward with grad, reads
those rows' old_logp from it, scores only the other rows, and keeps the forward; the update's
first optimizer step backpropagates it (`take_ahead`) instead of running it again. The same
bits as a replay of every row, one micro-batch's forward fewer.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from qarl.config import TrainSection
from qarl.model.decoder import checkpointed_layers
from qarl.rollout import LocalEngine
from qarl.train.learner.embedding import rows_into_gradient
from qarl.train.learner.logprobs import ForwardScorer, response_logprobs
from qarl.train.learner.precision import Precision
from qarl.train.phases import Experience
from qarl.types import RolloutBatch, SamplingParams


class Passes:
    """The passes of the learner `model` (module docstring). `replayer`: the value pass (None
    on an FSDP follower rank, which only runs gradient forwards); `solo`: one process (a
    rank's update splits its micro-batches with the others, so none runs ahead);
    `routing_replay`: MoE layers use the engine's experts (quant.routing_replay)."""

    def __init__(self, model: nn.Module, replayer: LocalEngine | ForwardScorer | None,
                 precision: Precision, train: TrainSection, routing_replay: bool = False,
                 solo: bool = True):
        self.model, self.replayer, self.precision = model, replayer, precision
        self.micro_batch_size = train.micro_batch_size
        self.checkpointing = train.gradient_checkpointing
        self.routing_replay = routing_replay
        self.own_values = (isinstance(replayer, ForwardScorer)
                           and replayer.is_gradient_pass(precision.compute, self.micro_batch_size))
        self.reads_ahead = solo and not routing_replay and self.own_values
        # a tied embedding's gradient rows straight into its weight's gradient (embedding.py)
        self.rows_into_gradient = rows_into_gradient(model, solo)
        self._ahead: tuple[RolloutBatch, tuple[Tensor, Tensor]] | None = None

    def replay(self, batch: RolloutBatch, sampling: SamplingParams, for_update: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        """(old_logp [N, L] float32, the experts the learner's routers chose [N, P + L,
        moe_layers, k] int16 or None) by the value pass; for_update: the old_logp phase of a
        step whose update of `batch` follows (the forward run ahead, module docstring)."""
        self._ahead = None  # a forward kept for a batch whose update never came
        if not (for_update and self.reads_ahead and torch.is_grad_enabled()):
            return self.replayer.score_routing(batch, sampling, replay=self.routing_replay)
        ahead = self.first_forward(batch, sampling.temperature)
        first = ahead[0].shape[0]
        logp = self.replayer.score_part(batch, sampling, range(first, batch.num_sequences))
        logp[:first] = ahead[0].detach()
        self._ahead = (batch, ahead)
        return logp, None

    def first_forward(self, batch: RolloutBatch, temperature: float) -> tuple[Tensor, Tensor]:
        """The gradient forward of the update's first micro-batch (rows 0 ..
        micro_batch_size-1), run as the update runs it: train mode, the gradient pass, the
        layers checkpointed where the update checkpoints them."""
        idx = torch.arange(min(batch.num_sequences, self.micro_batch_size),
                           device=batch.response_ids.device)
        self.model.train()
        try:
            with self.checkpointed():
                return self.gradient(batch.select(idx), temperature)
        finally:
            self.model.eval()

    def take_ahead(self, batch: RolloutBatch) -> tuple[Tensor, Tensor] | None:
        """The first micro-batch's gradient forward run ahead for `batch`, or None; given once."""
        ahead, self._ahead = self._ahead, None
        return ahead[1] if ahead is not None and ahead[0] is batch else None

    def gradient(self, sub: RolloutBatch, temperature: float) -> tuple[Tensor, Tensor]:
        """The gradient forward of one micro-batch `sub`: (logp [n, L] float32 with grad,
        entropy [n, L]) in the gradient pass."""
        with self.precision.gradient_pass():
            return response_logprobs(self.model, sub, temperature,
                                     routing_replay=self.routing_replay)

    def checkpointed(self) -> AbstractContextManager:
        """The block in which the decoder layers run under activation checkpointing
        (train.gradient_checkpointing), their recompute in the gradient pass's context."""
        recompute = self.precision.gradient_pass if self.checkpointing else None
        return checkpointed_layers(self.model, recompute)

    def later(self, exp: Experience, rows: range) -> Tensor | None:
        """logp's value at an optimizer step after the first, for that step's `rows` ([N, L]
        float32, only `rows` read), or None where it is the gradient forward's own."""
        return None if self.own_values else self.values(exp, rows)

    def values(self, exp: Experience, rows: range) -> Tensor:
        """The value pass with the current weights: the decode-path replay of the whole
        batch, or the forward scorer's micro-batches that hold `rows`, each split as
        old_logp's was. [N, L] float32."""
        if isinstance(self.replayer, ForwardScorer):
            return self.replayer.score_part(exp.batch, exp.sampling, rows, self.routing_replay)
        return self.replayer.score_routing(exp.batch, exp.sampling, replay=self.routing_replay)[0]

    def values_line(self) -> str:
        """The run's start line on where logp's values come from, under train.logp_path =
        'forward' (the decode-path replay is the default and needs no line)."""
        later = ("read from its own gradient forward, which computes the same bits"
                 if self.own_values else "that forward again")
        first = (" (the first micro-batch's: the values of the update's first gradient "
                 "forward, run ahead)" if self.reads_ahead else "")
        return ("logp values (train.logp_path = 'forward'): old_logp by the learner's "
                f"teacher-forced forward without grad, {self.micro_batch_size} rows at a "
                f"time{first}, not the decode-path replay; each later optimizer step's: {later}")

    def release_caches(self) -> None:
        """Free what the value pass built for the current weights (`Engine.release_caches`)."""
        if self.replayer is not None:
            self.replayer.release_caches()
