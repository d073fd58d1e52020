"""The math of the learner's logprobs (`Passes` runs them: qarl.train.learner.passes).

Two ways to compute logp(response | prompt) for a RolloutBatch:

- `response_logprobs` (with grad): a forward of prompt + response, each distinct prompt
  computed once for the rows that share it (a group's responses: `_predicting_hidden`), then
  lm_head + log-softmax at response positions only, in chunks of `chunk_tokens` response
  positions, every chunk but the last under activation checkpointing, so no [N, L, vocab]
  float32 tensor is ever kept for the batch: at most one chunk's [chunk, vocab] logits
  beside the layers' activations (an earlier chunk's logits are recomputed in backward; the
  last chunk's are kept from the end of the forward to the start of the backward, where its
  recompute would hold them anyway).
- the replay (no grad, exact; `Learner.replay`): the engine's own prefill +
  decode path with the sampled tokens forced instead of drawn (`LocalEngine.score` on a
  LocalEngine around the learner model). On CPU this is what makes
  `old_logp == rollout_logp` bit for bit: same kernels, same shapes, same summation order.
  A full-sequence forward computes the same function with other shapes (attention over a KV
  cache vs a causal pass, other GEMM paths): last bits apart in full precision, but
  activation quantizers amplify that into whole rounding steps. The replay must also use the
  batch shape that was sampled. Why: docs/alignment.md; how far apart, per scheme: `qarl
  parity` (benchmarks/parity_table.py).

`ForwardScorer` is the replay's stand-in under `train.logp_path = 'forward'` (naive and fake
alignment): logp values by `response_logprobs` without grad.

`aligned_logprobs` combines them for the update: the value of the exact path with the
gradient of the fast one, `logp = exact + (fast - sg(fast))`. Its value is bit-identical to
`exact` (x - x = 0 exactly) and its gradient is the fast path's, which computes the same
function (QuantLinear straight-through, the scheme's quantizers) and differs from the exact
path only by rounding: reduction order, a BLAS GEMM where a format's kernel is an emulation
(`Scheme.kernel_for_gradients`), bf16 under train.compute_dtype.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from qarl import native
from qarl.model.cache import SharedPrefixCache
from qarl.model.decoder import CausalLM, Routing, positions_from_mask
from qarl.model.packing import Packing
from qarl.lora.layers import lora_names
from qarl.rollout.sampling import kept_logprobs, token_logprobs
from qarl.train.learner.precision import Precision, lm_head_logits
from qarl.types import RolloutBatch, SamplingParams, kept_rows_mask


class _NativeTokenLogp(torch.autograd.Function):
    """logp [C] (with grad) and entropy [C] (without) of logits [C, V] on the CPU, by
    qarl.native's one-pass kernels (`native.token_logp`): the same values as the PyTorch ops
    below to fp32 rounding, and the gradient (g / T)(onehot - softmax) written once, in the
    logits' dtype, where PyTorch's logsumexp, log-softmax, entropy and their backward make a
    new [C, V] fp32 tensor per op (benchmarks/step_time.py times the update)."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature):
        logp, entropy, logz = native.token_logp(logits, tokens, temperature)
        ctx.save_for_backward(logits, tokens, logz)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad, _):
        logits, tokens, logz = ctx.saved_tensors
        dz = native.token_logp_backward(logits, tokens, ctx.temperature, logz, grad)
        return dz, None, None


def _chunk_logprobs_and_entropy(lm_head, hidden: Tensor, tokens: Tensor, temperature: float):
    # hidden: [C, H], tokens: [C] -> logp [C] float32, entropy [C] float32 (no grad)
    logits = lm_head_logits(lm_head, hidden)
    if logits.is_cpu and logits.dtype in (torch.float32, torch.bfloat16) and native.available():
        return _NativeTokenLogp.apply(logits, tokens, temperature)
    logp = token_logprobs(logits, tokens, temperature)
    with torch.no_grad():
        logz = torch.log_softmax(logits.float() / temperature, dim=-1)  # [C, V]
        # H = -sum_v p_v log p_v
        entropy = -(logz.exp() * logz).sum(-1)
    return logp, entropy


def _chunk_kept_logprobs_and_entropy(lm_head, hidden: Tensor, tokens: Tensor,
                                     temperature: float, kept: Tensor):
    # hidden: [C, H], tokens: [C], kept: [C, V] bool -> logp [C], entropy [C] (no grad), both
    # under softmax(logits / T) restricted to the sampler's kept set and renormalized
    logits = lm_head_logits(lm_head, hidden)
    logp = kept_logprobs(logits, tokens, temperature, kept)
    with torch.no_grad():
        logz = torch.log_softmax((logits.float() / temperature).masked_fill(~kept, -math.inf),
                                 dim=-1)  # [C, V], -inf outside the kept set
        p = logz.exp()
        entropy = -(p * logz.masked_fill(~kept, 0.0)).sum(-1)
    return logp, entropy


def _predicting_hidden(model: CausalLM, batch: RolloutBatch, routing: Routing | None) -> Tensor:
    """The hidden states that predict each response token, [N, L, H]: column t is the state
    at prompt + response position P-1+t. Rows that share a prompt (a group's responses) share
    its forward (`SharedPrefixCache`): each distinct prompt runs once, then every row's
    response against its prompt's keys and values; the same function as one pass over every
    row's prompt + response, up to GEMM rounding. MoE routing replay takes the one-pass
    forward (its expert records are per row). A dense model runs the prompts and the
    responses in one pass (`SharedPrompts`: one GEMM per layer and weight for both), its
    responses packed (`Packing`): the padding after the responses shorter than the batch's
    longest, and each response's last token, cost only their attention slots. A MoE model
    runs the prompts, then the padded responses (a MoE block routes [B, T] rows). The
    one-pass forward (no prompt shared: SFT's batches) keeps the padded pass."""
    P, L = batch.prompt_ids.shape[1], batch.response_ids.shape[1]
    seq_mask = batch.sequence_mask()  # [N, P + L]
    positions = positions_from_mask(seq_mask)
    prompts, rows = _distinct_prompts(batch)
    if routing is not None or prompts is None:
        hidden = model(batch.sequence_ids(), positions=positions, key_mask=seq_mask,
                       routing=routing)  # [N, P+L, H]
        return hidden[:, P - 1 : P - 1 + L]
    cache = SharedPrefixCache(rows)
    ids, mask = batch.prompt_ids[prompts], batch.prompt_mask[prompts]  # [G, P]
    if L > 1 and not model.config.moe_layers:
        # the prompts and the continuation in one pass (`CausalLM.forward_shared`), of the
        # continuation only the inputs that predict a response token: the padding after a
        # short response (rollouts are padded to the batch's longest) and each row's last
        # token compute nothing
        keep = batch.response_mask[:, 1:]  # [N, L-1] bool
        prompt_hidden, cont = model.forward_shared(
            ids, positions[prompts, :P], mask, batch.response_ids[:, : L - 1],
            positions[:, P : P + L - 1], seq_mask[:, : P + L - 1], keep, cache)
        return torch.cat([prompt_hidden[:, -1:].index_select(0, rows),
                          Packing.of(keep).pad(cont)], dim=1)
    last = model(ids, positions=positions[prompts, :P], key_mask=mask, cache=cache)[:, -1:]
    if L == 1:
        return last.index_select(0, rows)
    cont = model(batch.response_ids[:, : L - 1], positions=positions[:, P : P + L - 1],
                 key_mask=seq_mask[:, : P + L - 1], cache=cache, cache_start=P)  # [N, L-1, H]
    return torch.cat([last.index_select(0, rows), cont], dim=1)


def _distinct_prompts(batch: RolloutBatch) -> tuple[Tensor | None, Tensor]:
    """(the first row of each distinct prompt [G], each row's index into them [N]), or
    (None, _) when no two rows share a prompt."""
    key = batch.prompt_ids.masked_fill(~batch.prompt_mask, -1)  # padding ids never matter
    unique, rows = torch.unique(key, dim=0, return_inverse=True)
    if unique.shape[0] == key.shape[0]:
        return None, rows
    first = torch.full((unique.shape[0],), key.shape[0], dtype=torch.long, device=key.device)
    first = first.scatter_reduce(0, rows, torch.arange(key.shape[0], device=key.device), "amin")
    return first, rows


def response_logprobs(
    model: CausalLM, batch: RolloutBatch, temperature: float = 1.0, chunk_tokens: int = 512,
    routing_replay: bool = False,
) -> tuple[Tensor, Tensor]:
    """Teacher-forced logprobs of the response tokens: ([N, L] float32, entropy [N, L]).

    Both are 0 on padding. Gradients reach every parameter through the chunked lm_head.
    routing_replay: MoE layers use the batch's `routed_experts` (the engine's choice).
    A batch with kept sets (a truncating sampler's) is scored under the sampler's truncated,
    renormalized distribution: the logits of tokens it did not keep take no part and get no
    gradient (`qarl.rollout.sampling.kept_logprobs`).
    """
    routing = Routing(replay=batch.routed_experts) if routing_replay else None
    predicting = _predicting_hidden(model, batch, routing)  # [N, L, H]
    mask = batch.response_mask
    flat_hidden = predicting[mask]  # [T, H] response tokens only: padding costs nothing
    flat_tokens = batch.response_ids[mask]  # [T]
    kept = _KeptChunks(batch) if batch.kept_counts is not None else None
    logps, entropies = [], []
    T = flat_tokens.numel()
    for start in range(0, T, chunk_tokens):
        h = flat_hidden[start : start + chunk_tokens]
        y = flat_tokens[start : start + chunk_tokens]
        step, args = _chunk_logprobs_and_entropy, (model.lm_head, h, y, temperature)
        if kept is not None:
            step = _chunk_kept_logprobs_and_entropy
            args += (kept.mask(start, y.numel(), model.config.vocab_size),)
        # the last chunk's backward comes first: its logits, kept, cost no more memory than
        # a recompute there, and one lm_head GEMM less (benchmarks/roofline.py, the update)
        if torch.is_grad_enabled() and h.requires_grad and start + chunk_tokens < T:
            lp, ent = checkpoint(step, *args, use_reentrant=False)
        else:
            lp, ent = step(*args)
        logps.append(lp)
        entropies.append(ent)
    logp = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    entropy = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if logps:
        logp = logp.masked_scatter(mask, torch.cat(logps))
        entropy = entropy.masked_scatter(mask, torch.cat(entropies).detach())
    return logp, entropy


class _KeptChunks:
    """The kept sets of a batch's real response tokens (row-major, as `response_ids[mask]`),
    handed out a chunk at a time as [C, V] bool masks: never one mask for the whole batch."""

    def __init__(self, batch: RolloutBatch):
        self.ids = batch.kept_ids
        self.counts = batch.kept_counts.long()[batch.response_mask]  # [T]
        self.starts = batch.kept_starts()[batch.response_mask]  # [T]

    def mask(self, start: int, size: int, vocab: int) -> Tensor:
        part = slice(start, start + size)
        return kept_rows_mask(self.ids, self.starts[part], self.counts[part], vocab)


class ForwardScorer:
    """What `Learner.replay` runs under `train.logp_path = 'forward'`: the learner's
    teacher-forced forward of `model` without grad (`response_logprobs`), `rows` rows at a time,
    in an fp32 pass on the machine's fp32 GEMM library (`Precision.fp32_pass`). Every call splits a
    batch alike, so two calls at the same weights give the same bits: logp's value at a later
    optimizer step equals old_logp exactly where the weights did not move. It is the value
    verl's `compute_log_prob` and TRL take, and no pass of a `naive` or `fake` learner equals
    the sampler's anyway; it differs from the decode-path replay by the rounding of other
    shapes (docs/learner.md#logp-values-by-the-forward). No routing table: a MoE model's
    routing-disagreement metric needs the decode-path replay."""

    def __init__(self, model: CausalLM, rows: int, precision: Precision):
        self.model, self.rows, self.precision = model, rows, precision

    def score_routing(self, batch: RolloutBatch, sampling: SamplingParams,
                      replay: bool = False) -> tuple[Tensor, None]:
        """(logp [N, L] float32, None); replay: MoE layers use the batch's routed_experts."""
        return self.score_part(batch, sampling, range(batch.num_sequences), replay), None

    def score_part(self, batch: RolloutBatch, sampling: SamplingParams, rows: range,
                   replay: bool = False) -> Tensor:
        """logp [N, L] float32 of the chunks that hold `rows` (0 on every other row): the
        same bits for those rows as a call on the whole batch, since each chunk is computed
        on its own."""
        N = batch.num_sequences
        device = batch.response_ids.device
        logp = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=device)
        first = rows.start - rows.start % self.rows
        with torch.no_grad(), self.precision.fp32_pass():
            for start in range(first, min(N, rows.stop), self.rows):
                stop = min(N, start + self.rows)
                sub = batch.select(torch.arange(start, stop, device=device))
                logp[start:stop] = response_logprobs(self.model, sub, sampling.temperature,
                                                     routing_replay=replay)[0]
        return logp

    def is_gradient_pass(self, compute: torch.dtype, micro_batch_size: int) -> bool:
        """Whether the update's gradient forward computes this scorer's bits, so that an
        optimizer step after the first takes logp's value from that forward instead of a
        second one without grad (`Learner.update`): an fp32 gradient pass (train.compute_dtype)
        split as this scorer splits (`rows` = train.micro_batch_size), on a learner without
        LoRA adapters (whose product takes the native kernel only without grad). The fake and
        naive layers run one function with grad and without (tests/integration/
        test_logp_path.py holds them to the bit)."""
        return (compute == torch.float32 and micro_batch_size == self.rows
                and not lora_names(self.model))

    def release_caches(self) -> None:
        """Nothing is cached across weight versions."""


def aligned_logprobs(fast_logp: Tensor, exact_logp: Tensor) -> Tensor:
    """Value of `exact_logp`, gradient of `fast_logp` (both [N, L] float32)."""
    return exact_logp.detach() + (fast_logp - fast_logp.detach())

