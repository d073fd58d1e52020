"""`Engine`: what the trainer needs from a rollout engine, whatever runs the model.

`qarl.rollout.LocalEngine` implements it in this process, `qarl.rollout.vllm_engine.VLLMEngine`
with vLLM, `qarl.parallel.RayEngines` over Ray actors of either: the same members with the
same promises, so the trainer, the evaluator and `qarl parity` work with any of them
(`qarl.rollout.engines.ENGINES` names the kinds a recipe can ask for).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from torch import Tensor

from qarl.quant import QWeight
from qarl.quant.delta import StateDelta
from qarl.types import RolloutBatch, SamplingParams


@runtime_checkable
class Engine(Protocol):
    """A rollout engine: samples responses with sampler logprobs, scores given responses on
    the same path, and takes new weights from the learner."""

    # Called while generating, where stopping is safe (the local engine: before every decode
    # step); may raise to abandon the call. The trainer sets its SIGTERM / SIGINT check.
    stop_check: Callable[[], None]
    pad_token_id: int  # fills prompt and response padding

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int,
        row_offset: int = 0, prompt_width: int = 0,
    ) -> RolloutBatch:
        """One response per prompt (token ids, no tokenization), as a `RolloutBatch`: prompts
        left-padded, responses right-padded, `finish_reasons` "stop" (an EOS or stop id, kept
        as the response's last token) or "length" (max_new_tokens or the context limit).

        Determinism: the same weights, prompts, sampling and seed give the same batch, bit
        for bit; the seed is the only source of randomness (no global RNG is read or moved).
        Prompt i's response draws from a stream derived from (seed, row_offset + i) alone, so
        a batch split into shards (each called with its first row's index as row_offset)
        samples the tokens of the whole batch (`qarl.parallel.RayEngines` relies on it).
        `prompt_width`: the least number of prompt columns (the whole batch's width when a
        shard is generated), so every shard pads like the whole batch; an engine without
        padded batches ignores it.

        `rollout_logp` [N, L] float32 is, for each response token, the log-probability of that
        token under exactly the distribution it was drawn from: softmax(logits / temperature)
        truncated to top_k, then to the top_p nucleus, renormalized; for greedy decoding the
        log-softmax of the raw logits. 0 on padding. Invalid prompts (empty list, empty prompt,
        ids outside the vocabulary, no room in the context) raise ValueError."""
        ...

    def score(self, batch: RolloutBatch, sampling: SamplingParams) -> Tensor:
        """Forced-token scoring: [N, L] float32, the logprob `generate` would report for each
        token of `batch.response_ids` (0 on padding), computed by replaying generation with
        each drawn token replaced by the batch's token (same prefill, same decode steps, same
        batch rows in the same order, same kernels, same sampler logprob function).

        Replay is exact: with the weights that generated `batch` (the same engine, or another
        engine of the same kind around a model with identical weights) and the same sampling,
        the result equals `batch.rollout_logp` bit for bit. A batch whose response_mask does
        not follow from its tokens and the engine's stop ids raises ValueError."""
        ...

    def load_weights(self, state: dict, partial: bool = False) -> None:
        """Install the learner's weights, in place, before the next generate / score.

        `state` maps parameter names of the model (`model.layers.0.self_attn.q_proj.weight`)
        to a `qarl.quant.QWeight` (codes and scales of a quantized layer, used as-is, never
        re-quantized) or a Tensor (copied into the parameter or buffer): what
        `qarl.quant.export_state(learner)` returns. Every name of the model's state dict must
        be present and no other (else KeyError); with `partial`, a subset of those names (a
        LoRA run's adapters) and the rest stays; a QWeight for a layer that is not quantized
        with the same scheme and options raises. After it returns, no output is computed from
        the previous weights."""
        ...

    def delta_loader(self) -> "DeltaLoader | None":
        """The engine's capability to take weight deltas (`DeltaLoader`), or None where it
        takes whole states only."""
        ...

    def describe(self) -> dict[str, str]:
        """What runs, per part of the model: module name (`model.layers.3`, `lm_head`, ...) ->
        a sentence naming the path (e.g. a fused native block, a fused PyTorch block, a
        packed linear, the module's own forward) and the kernel behind its GEMMs. For logs
        and reports; the wording is not a stable interface."""
        ...

    def qweights(self) -> dict[str, QWeight]:
        """The codes and scales the engine decodes with, per quantized layer name (empty for
        full-precision rollouts): what the weight sync compares from step to step."""
        ...

    def weight_digests(self) -> list[dict[str, tuple[int, ...]]]:
        """Per replica of the policy the engine samples with (one, or one per Ray actor): the
        digests of what it holds, keyed like `qarl.quant.digests.state_digests` of the last
        state it installed (`qarl.quant.digests.engine_digests`): the weight sync compares
        them with the learner's after every push (the quantization contract)."""
        ...

    def release_caches(self) -> None:
        """Free what the engine built for its current weights to run them faster (the local
        engine's packed layouts): the trainer calls it after a step's rollouts, before the
        update that changes those weights, so the update's peak memory does not hold them.
        The next generate / score builds what it needs again, for whatever weights it has
        then; no output changes."""
        ...

    def close(self) -> None:
        """Release what the engine holds outside this object (actors, processes); a no-op
        for an engine that holds none. The engine is not used after."""
        ...


@runtime_checkable
class DeltaLoader(Protocol):
    """An engine that takes only what changed since the weight version it holds
    (`qarl.quant.delta`): the weight sync pushes a whole state labelled with a version, then
    deltas from each version to the next, and a whole state again to any replica that holds
    another version (new, restarted, or one that missed a push)."""

    # whether a push to it crosses machines (Ray actors on other nodes than the learner):
    # where a delta's fewer bytes can pay for its encoding (`quant.sync_delta = "auto"`)
    crosses_machines: bool

    def versions(self) -> list[int | None]:
        """Per replica (one, or one per Ray actor): the weight version it holds; None for an
        engine whose weights came another way (a plain `load_weights`, or none yet)."""
        ...

    def load_versioned(self, state: dict, version: int) -> None:
        """`Engine.load_weights(state)` of a whole state, which every replica then holds as
        `version`."""
        ...

    def load_delta(self, delta: StateDelta) -> None:
        """Apply `delta` (from version `delta.base` to `delta.version`) in every replica, in
        place, with the effect of a whole push of the new version: no output is computed from
        the previous weights after it returns. A replica that holds another version than
        `delta.base` raises `StaleWeights` and takes nothing (one that already holds
        `delta.version` takes nothing and does not raise)."""
        ...


class StaleWeights(RuntimeError):
    """A weight delta sent to an engine that does not hold the version it was encoded from."""
