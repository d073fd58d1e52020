"""The local rollout engine: batched KV-cache generation with any `CausalLM` in this process.

Generation is a few small functions with one job each (after gpt-fast): `prefill` runs the
left-padded prompts once and returns the last position's logits, `decode_one_token` feeds
one token per row through the preallocated cache, and `qarl.rollout.sampling.sample` turns
logits into tokens and sampler logprobs. `LocalEngine.generate` strings them together and
keeps the bookkeeping (finished rows, masks, finish reasons) vectorized: no Python work per
row per step.

Layout: prompts are left-padded to P columns, so every row's last prompt token sits in cache
slot P-1 and decode step t writes slot P+t for all rows at once. RoPE positions skip the pads
(row b's first real token has position 0) and `key_mask` marks the real slots. When at least
half of the rows still decoding have finished, the batch is compacted (`KVCache.reorder`), so
finished rows stop costing compute; their remaining response slots are padding, masked out,
with logprob 0.

The engine runs its own decode plan (`qarl.rollout.plan`), built from the model and cached
with its packed weights: fused blocks on packed weights (qarl.native's panels and kernels
where they run, oneDNN's blocked layout otherwise; stacked QWeights for quantized blocks),
or each layer's own forward. The model object itself is never modified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from qarl.model.cache import KVCache
from qarl.model.decoder import CausalLM, positions_from_mask
from qarl.quant import load_state, quant_layers
from qarl.quant.digests import engine_digests
from qarl.rollout.deltas import EngineDeltas
from qarl.rollout.plan import DecodePlan, DecodePlanner
from qarl.rollout.routing import RoutingTable
from qarl.rollout.sampling import kept_logprobs, row_uniforms, sample, sampler_logprobs
from qarl.types import FINISH_LENGTH, FINISH_STOP, RolloutBatch, SamplingParams

# Compact the batch once the rows still decoding are at most this fraction of the cache rows.
_COMPACT_BELOW = 0.5


def prefill(
    plan: DecodePlan, ids: Tensor, positions: Tensor, cache: KVCache, key_mask: Tensor
) -> Tensor:
    """ids, positions: [B, P] int64; key_mask: [B, S] bool -> logits [B, V] at the last column."""
    hidden = plan.hidden(ids, positions, cache, 0, key_mask)
    return plan.lm_head(hidden[:, -1])  # lm_head on one position per row only


def decode_one_token(
    plan: DecodePlan, tokens: Tensor, positions: Tensor, cache: KVCache, slot: int,
    key_mask: Tensor,
) -> Tensor:
    """tokens, positions: [B] int64 written at cache `slot`; key_mask: [B, S] bool -> [B, V]."""
    hidden = plan.hidden(tokens[:, None], positions[:, None], cache, slot, key_mask)
    return plan.lm_head(hidden[:, 0])


class LocalEngine:
    """Generates rollouts with a `CausalLM` (quantized or not) in this process; implements
    `qarl.rollout.Engine`.

    eos_token_ids: ids that end a response (kept in it); None = `model.config.eos_token_ids`,
    () = none. pad_token_id fills prompt and response padding. max_context bounds prompt +
    response length (default `model.config.max_position_embeddings`): generation stops there
    with finish reason "length" even before `max_new_tokens`. prepack_weights: on CPU, decode
    plain fp32 linears on packed weights (qarl.native's panels, or oneDNN's blocked layout
    without it) and decoder blocks as fused blocks (faster; rounding differs from `F.linear`
    by fp32 summation order, see `qarl.rollout.prepack`); False runs each module's own forward.
    fuse_blocks: False packs each linear on its own instead of fusing blocks (for comparison).
    share_prompts: rows with the same prompt (a GRPO group) prefill once and copy its keys,
    values and logits: the same bits as a prefill per row; False prefills every row.
    """

    # Called before every decode step; may raise to abandon generation (the trainer sets
    # its SIGTERM / SIGINT check, qarl.train.signals).
    stop_check: Callable[[], None] = staticmethod(lambda: None)

    def __init__(
        self,
        model: CausalLM,
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int = 0,
        max_context: int | None = None,
        prepack_weights: bool = True,
        fuse_blocks: bool = True,
        share_prompts: bool = True,
    ):
        vocab = model.config.vocab_size
        self.model = model
        self.eos_token_ids = tuple(
            model.config.eos_token_ids if eos_token_ids is None else eos_token_ids
        )
        self.pad_token_id = pad_token_id
        self.share_prompts = share_prompts
        self.weight_version: int | None = None  # what it holds (deltas.py); None: unlabelled
        self._planner = DecodePlanner(prepack_weights, fuse_blocks)
        self.max_context = (
            model.config.max_position_embeddings if max_context is None else max_context
        )
        bad = [i for i in (*self.eos_token_ids, pad_token_id) if not 0 <= i < vocab]
        if bad:
            raise ValueError(
                f"eos/pad token ids {bad} are outside the model vocabulary [0, {vocab}); "
                "pass the ids of the tokenizer that matches this model"
            )

    @classmethod
    def from_tokenizer(
        cls, model: CausalLM, tokenizer, max_context: int | None = None
    ) -> "LocalEngine":
        """Take EOS and pad ids from a tokenizer with `.eos_token_ids` and `.pad_token_id`
        (a missing pad id falls back to the first EOS id, then to 0)."""
        eos = tuple(tokenizer.eos_token_ids)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = eos[0] if eos else 0
        return cls(model, eos_token_ids=eos, pad_token_id=pad, max_context=max_context)

    def load_weights(self, state: dict, partial: bool = False) -> None:
        """Install new weights in place (QWeights as-is, plain tensors copied) via
        `qarl.quant.load_state` (`partial`: a subset of the names); the engine keeps using
        the same module objects, and the next call repacks whatever changed."""
        with torch.no_grad():
            load_state(self.model, state, strict=not partial)
        self.weight_version = None

    def delta_loader(self) -> "EngineDeltas":
        """`Engine.delta_loader`: deltas applied in place to its layers' codes (deltas.py)."""
        return EngineDeltas(self)

    def qweights(self) -> dict:
        """The codes and scales each quantized layer decodes with (`Engine.qweights`)."""
        return {name: layer.qweight() for name, layer in quant_layers(self.model).items()}

    def weight_digests(self) -> list[dict[str, tuple[int, ...]]]:
        """`Engine.weight_digests`: of the model the decode plan packs its weights from."""
        return [engine_digests(self.model)]

    def release_caches(self) -> None:
        """`Engine.release_caches`: drop the decode plan's packs (packed panels, row-stacked
        codes, the packed lm_head; peak RSS: benchmarks/step_time.py --rounds). A pack is
        rebuilt whenever the weights it was built from change, so between a step's rollouts and
        the push of the updated weights it is never read again."""
        self._planner.clear()

    def close(self) -> None:
        """Nothing to release: the engine lives in this process."""

    def describe(self) -> dict[str, str]:
        """What the next generate / score runs, per module name (every decoder layer, the
        linears of layers that run their own forward, the lm_head). Builds a plan for the
        current weights without keeping it, so describing never changes later outputs."""
        with torch.inference_mode():
            return self._planner.paths(self.model)

    def generate(
        self, prompt_ids: list[list[int]], sampling: SamplingParams, seed: int,
        row_offset: int = 0, prompt_width: int = 0,
    ) -> RolloutBatch:
        """Sample one response per prompt. Same seed, same model, same prompts: same tokens.
        Prompt i draws from the stream of row `row_offset + i` (`qarl.rollout.sampling`).
        Prompts are left-padded to at least `prompt_width` columns: a shard of a batch padded
        like the whole batch computes each row bit for bit as the whole batch does (the
        kernels are batch-invariant, but attention over a different number of pad slots is not).

        `rollout_logp` is the log-probability of each drawn token under exactly the
        distribution it was drawn from (after temperature, top-k and top-p, renormalized); for
        greedy decoding it is the log-softmax of the raw logits. See `qarl.rollout.sampling`.
        """
        device = self.model.model.embed_tokens.weight.device
        ids, prompt_mask = self._left_pad(prompt_ids, device, prompt_width)  # [N, P] each
        budget = self._response_budget(ids.shape[1], sampling.max_new_tokens)
        uniforms = None if sampling.greedy else row_uniforms(seed, row_offset, len(ids), budget)
        routing = RoutingTable(self.model, len(prompt_ids), ids.shape[1] + budget)
        kept = KeptSets(len(prompt_ids), budget) if sampling.truncates else None
        with torch.inference_mode():
            plan = self._planner.plan(self.model, batch_hint=len(prompt_ids))
            response, logp, mask, stopped = self._decode(
                plan, ids, prompt_mask, budget, sampling, uniforms, routing, kept=kept
            )
        length = int(mask.sum(dim=1).max())  # the longest response sets L
        routed = routing.table
        counts, kept_ids = (None, None) if kept is None else kept.compact(length)
        return RolloutBatch(
            prompt_ids=ids,
            prompt_mask=prompt_mask,
            response_ids=response[:, :length].clone(),
            response_mask=mask[:, :length].clone(),
            rollout_logp=logp[:, :length].clone(),
            finish_reasons=[FINISH_STOP if s else FINISH_LENGTH for s in stopped.tolist()],
            routed_experts=None if routed is None else routed[:, : ids.shape[1] + length].clone(),
            kept_counts=counts, kept_ids=kept_ids,
        )

    def score(self, batch: RolloutBatch, sampling: SamplingParams) -> Tensor:
        """Sampler logprobs of the responses already in `batch`, by replaying generation: the
        same prefill, the same decode steps, the same batch compaction, with each drawn token
        replaced by the batch's token. -> [N, L] float32, 0 on padding.

        This is the engine-path teacher forcing the aligned learner uses for old_logp: with
        the same weights and the same batch it reproduces `batch.rollout_logp` bit for bit
        (a full-sequence forward differs from the decode path in the last bits). A batch with
        kept sets (a truncating sampler's) is scored under them (`kept_logprobs`), not under
        a truncation of this model's own logits.
        """
        return self.score_routing(batch, sampling)[0]

    def score_routing(self, batch: RolloutBatch, sampling: SamplingParams,
                      replay: bool = False) -> tuple[Tensor, Tensor | None]:
        """`score`, and the experts this model's routers chose ([N, P + L, moe_layers, k]
        int16 as `RolloutBatch.routed_experts`; None for a dense model). replay: the MoE
        layers use the batch's `routed_experts` (the generating engine's choice) instead of
        their own top-k (routing replay)."""
        L = batch.response_ids.shape[1]
        if replay and batch.routed_experts is None:
            raise ValueError("score_routing(replay=True) needs a batch with routed_experts: "
                             "one generated by a LocalEngine around a MoE model")
        routing = RoutingTable(self.model, batch.num_sequences, batch.prompt_ids.shape[1] + L,
                               replay=batch.routed_experts if replay else None)
        with torch.inference_mode():
            plan = self._planner.plan(self.model, batch_hint=batch.num_sequences)
            _, logp, mask, _ = self._decode(
                plan, batch.prompt_ids, batch.prompt_mask, L, sampling, None, routing,
                forced=batch.response_ids,
                recorded=batch if batch.kept_counts is not None and sampling.truncates else None,
            )
        if not torch.equal(mask, batch.response_mask):
            raise ValueError(
                "score(): the batch's response_mask does not follow from its tokens (a row ends "
                "at its first EOS/stop id, or runs to the last column); pass a RolloutBatch "
                "produced by generate() with the same stop ids"
            )
        return logp, routing.table

    def _decode(self, plan, ids, prompt_mask, budget, sampling, uniforms,
                routing: RoutingTable, forced=None, kept: "KeptSets | None" = None,
                recorded: RolloutBatch | None = None):
        """The generation loop on `plan`. ids, prompt_mask: [N, P]; uniforms: [N, budget]
        float64 (None when greedy or scoring); forced: [N, budget] int64 tokens to feed
        instead of sampling (scoring), or None; every forward recorded in (and replayed from)
        `routing`; kept: where a truncating sampler's kept sets go; recorded: a batch whose
        kept sets score the forced tokens. Returns response [N, budget] int64, logp [N, budget] float32,
        mask [N, budget] bool, stopped [N] bool."""
        N, P = ids.shape
        device = ids.device
        stop_ids = torch.tensor(
            sorted({*self.eos_token_ids, *sampling.stop_token_ids}), dtype=torch.long, device=device
        )
        cache = self.model.new_cache(N, P + budget)
        key_mask = torch.zeros(N, P + budget, dtype=torch.bool, device=device)  # [N, S]
        key_mask[:, :P] = prompt_mask
        key_mask[:, P:] = True  # response slots of a live row are always real
        positions = positions_from_mask(prompt_mask)  # [N, P] pads skipped
        next_position = positions[:, -1] + 1  # [N] RoPE position of the next fed token

        response = torch.full((N, budget), self.pad_token_id, dtype=torch.long, device=device)
        logp = torch.zeros(N, budget, dtype=torch.float32, device=device)
        mask = torch.zeros(N, budget, dtype=torch.bool, device=device)
        stopped = torch.zeros(N, dtype=torch.bool, device=device)
        rows = torch.arange(N, device=device)  # [B] original row of each cache row
        live = torch.ones(N, dtype=torch.bool, device=device)  # [B] cache row still decoding

        logits = self._prefill(plan, ids, positions, cache, key_mask, prompt_mask, routing)
        starts = None if recorded is None else recorded.kept_starts()  # once, not per step
        for t in range(budget):
            self.stop_check()
            if forced is None:
                u = None if uniforms is None else uniforms[rows.cpu(), t]  # [B] float64
                tokens, token_logp, kept_now = sample(logits, sampling, u)  # [B] each
                if kept is not None:
                    kept.add(rows[live], t, kept_now[live])
            elif recorded is not None:
                tokens = forced[rows, t]  # [B]
                token_logp = kept_logprobs(logits, tokens, sampling.temperature,
                                           recorded.kept_mask(rows, t, logits.shape[-1], starts))
            else:
                tokens = forced[rows, t]  # [B]
                token_logp = sampler_logprobs(logits, tokens, sampling)  # [B]
            tokens = tokens.masked_fill(~live, self.pad_token_id)
            response[rows, t] = tokens
            logp[rows, t] = token_logp.masked_fill(~live, 0.0)
            mask[rows, t] = live
            hit = live & torch.isin(tokens, stop_ids)  # [B] emitted a stop id now
            stopped[rows] |= hit
            live &= ~hit
            if t == budget - 1:
                break
            num_live = int(live.sum())
            if num_live == 0:
                break
            if num_live <= _COMPACT_BELOW * live.numel():
                keep = live.nonzero().squeeze(1)  # [B'] cache rows to keep
                cache.reorder(keep)
                rows, tokens, next_position = rows[keep], tokens[keep], next_position[keep]
                key_mask, live = key_mask[keep], live[keep]
            with routing.record(rows, P + t, live[:, None]):
                logits = decode_one_token(plan, tokens, next_position, cache, P + t, key_mask)
            next_position += 1
        return response, logp, mask, stopped

    def _prefill(self, plan, ids, positions, cache: KVCache, key_mask, prompt_mask,
                 routing: RoutingTable) -> Tensor:
        """Prefill every row into `cache` -> logits [N, V] at the last column. Rows that share a
        prompt (GRPO's group of samples per prompt: same ids, same padding) are computed once
        and their keys, values and logits copied to the others: each row's prefill is a
        batch-invariant computation (`qarl.rollout.plan`), so its bits do not depend on
        which rows share the batch. A MoE model, whose routing is recorded per row, prefills
        every row."""
        rows = torch.arange(ids.shape[0], device=ids.device)
        if self.share_prompts and routing.table is None:
            distinct, inverse = torch.unique(torch.cat([ids, prompt_mask.long()], dim=1),
                                             dim=0, return_inverse=True)
            if len(distinct) < len(ids):
                first = torch.full((len(distinct),), len(ids), dtype=torch.long, device=ids.device)
                first = first.scatter_reduce(0, inverse, rows, reduce="amin")  # [U]
                once = self.model.new_cache(len(first), ids.shape[1])
                logits = prefill(plan, ids[first], positions[first], once, key_mask[first])
                cache.k[:, :, :, : ids.shape[1]] = once.k[:, inverse, :, : ids.shape[1]]
                cache.v[:, :, :, : ids.shape[1]] = once.v[:, inverse, :, : ids.shape[1]]
                return logits[inverse]
        with routing.record(rows, 0, prompt_mask):
            return prefill(plan, ids, positions, cache, key_mask)

    def _left_pad(self, prompt_ids: list[list[int]], device, width: int = 0) -> tuple[Tensor, Tensor]:
        return left_pad(prompt_ids, self.model.config.vocab_size, self.pad_token_id, device, width)

    def _response_budget(self, prompt_len: int, max_new_tokens: int) -> int:
        return response_budget(self.max_context, prompt_len, max_new_tokens)


class KeptSets:
    """The tokens a truncating sampler kept, gathered step by step during `generate` and
    compacted into `RolloutBatch.kept_counts` / `kept_ids` (row-major, ids ascending): only
    kept ids are held, never a [N, L, V] mask (benchmarks/truncation.py measures the cost)."""

    def __init__(self, rows: int, budget: int):
        self.rows, self.budget = rows, budget
        self.keys: list[Tensor] = []  # per step: [k] int64 row * budget + t of each kept id
        self.ids: list[Tensor] = []  # per step: [k] int32 the kept ids

    def add(self, rows: Tensor, t: int, kept: Tensor) -> None:
        """rows: [B] original rows still decoding; kept: [B, V] bool, their kept sets at t."""
        which, token = kept.nonzero(as_tuple=True)  # row-major: ascending ids per row
        self.keys.append(rows[which] * self.budget + t)
        self.ids.append(token.to(torch.int32))

    def compact(self, length: int) -> tuple[Tensor, Tensor]:
        """(kept_counts [N, length] int32, kept_ids [K] int32)."""
        keys = torch.cat(self.keys) if self.keys else torch.zeros(0, dtype=torch.long)
        ids = torch.cat(self.ids) if self.ids else torch.zeros(0, dtype=torch.int32)
        order = torch.argsort(keys, stable=True)  # (row, t) order; each step's ids stay sorted
        counts = torch.bincount(keys, minlength=self.rows * self.budget).view(
            self.rows, self.budget)[:, :length]
        return counts.to(torch.int32).contiguous(), ids[order].contiguous()


def left_pad(prompt_ids: list[list[int]], vocab: int, pad_token_id: int,
             device=None, width: int = 0) -> tuple[Tensor, Tensor]:
    """Validate and left-pad to P = max(longest prompt, width) columns: -> ids [N, P] int64,
    prompt_mask [N, P] bool."""
    if len(prompt_ids) == 0:
        raise ValueError("generate() got an empty prompt list; pass at least one prompt")
    lengths = [len(p) for p in prompt_ids]
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:
        raise ValueError(
            f"prompts {empty[:10]} are empty; every prompt needs at least one token "
            "(e.g. a BOS id) to condition on"
        )
    flat = torch.tensor([t for p in prompt_ids for t in p], dtype=torch.long)
    out_of_vocab = (flat < 0) | (flat >= vocab)
    if out_of_vocab.any():
        first = int(out_of_vocab.nonzero()[0])
        row = int((torch.tensor(lengths).cumsum(0) <= first).sum())
        raise ValueError(
            f"prompt {row} contains token id {int(flat[first])} outside the model "
            f"vocabulary [0, {vocab}); tokenize with the tokenizer of this model"
        )
    P = max(*lengths, width)
    length_t = torch.tensor(lengths)  # [N]
    prompt_mask = torch.arange(P)[None, :] >= P - length_t[:, None]  # [N, P] bool
    ids = torch.full((len(prompt_ids), P), pad_token_id, dtype=torch.long)
    ids[prompt_mask] = flat  # row-major fill = each prompt right-aligned in its row
    return ids.to(device), prompt_mask.to(device)


def response_budget(max_context: int, prompt_len: int, max_new_tokens: int) -> int:
    """Decode steps: max_new_tokens, cut so the longest prompt + response fits max_context."""
    room = max_context - prompt_len
    if room < 1:
        raise ValueError(
            f"the longest prompt has {prompt_len} tokens, which leaves no room for "
            f"max_new_tokens={max_new_tokens} within the context limit of "
            f"{max_context} tokens; shorten the prompt or raise max_context "
            "(at most the model's max_position_embeddings)"
        )
    return min(max_new_tokens, room)
