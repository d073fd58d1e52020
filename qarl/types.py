"""Plain data that crosses module boundaries: sampling settings and rollout batches.

Shapes use N = number of sequences, P = padded prompt length, L = padded response length.
Prompts are left-padded (real tokens end at column P-1), responses right-padded (real tokens
start at column 0), so prompt + response concatenated is one contiguous sequence per row.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

FINISH_STOP = "stop"  # emitted an EOS or stop id (the id is kept in the response)
FINISH_LENGTH = "length"  # hit max_new_tokens (or the context limit) first


@dataclass(frozen=True)
class SamplingParams:
    """How the engine turns logits into tokens.

    The sampler draws from softmax(logits / temperature) restricted to the top_k tokens, then
    to the smallest nucleus of mass >= top_p, then to the tokens of probability >= min_p times
    the most likely one's, renormalized. `rollout_logp` reports the log-probability of the
    drawn token under exactly that distribution. With the RL defaults (top_k=0, top_p=1.0,
    min_p=0.0) this equals log_softmax(logits / temperature). A truncating sampler records the
    tokens it kept at each position (`RolloutBatch.kept_ids`), and the learner scores the
    response under the same truncated, renormalized distribution (docs/learner.md).
    """

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k truncation
    min_p: float = 0.0  # keep tokens with p >= min_p * max p; 0 = off
    greedy: bool = False  # argmax decoding; temperature/top_p/top_k/min_p are then ignored
    stop_token_ids: tuple[int, ...] = ()  # in addition to the tokenizer's EOS ids

    def __post_init__(self) -> None:
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.greedy and not self.temperature > 0:
            problems.append(
                f"temperature must be > 0 when sampling, got {self.temperature}; "
                "use greedy=True for argmax decoding"
            )
        if not 0.0 < self.top_p <= 1.0:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            problems.append(f"min_p must be in [0, 1), got {self.min_p}")
        if problems:
            raise ValueError("invalid SamplingParams: " + "; ".join(problems))

    @property
    def truncates(self) -> bool:
        """Whether the sampler draws from fewer tokens than the whole vocabulary."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)

    def untruncated(self) -> "SamplingParams":
        """The same settings over the whole vocabulary (the learner's view of a truncating
        sampler under rollout.truncation_correction = false)."""
        return replace(self, top_k=0, top_p=1.0, min_p=0.0)


@dataclass
class RolloutBatch:
    """What an engine returns from `generate`: N sampled responses and how they were sampled."""

    prompt_ids: Tensor  # [N, P] int64, left-padded with pad_id
    prompt_mask: Tensor  # [N, P] bool, True on real prompt tokens
    response_ids: Tensor  # [N, L] int64, right-padded with pad_id after the finish
    response_mask: Tensor  # [N, L] bool, True on generated tokens (the final EOS included)
    rollout_logp: Tensor  # [N, L] float32, sampler logprob of each generated token; 0 on padding
    finish_reasons: list[str] = field(default_factory=list)  # N x FINISH_STOP | FINISH_LENGTH
    # MoE models: the experts the engine's router chose for each token it ran, per MoE layer
    # ([N, P + L, moe_layers, k] int16 over prompt + response columns; -1 where the token's
    # output is never used: padding, a row's last token). None for a dense model.
    routed_experts: Tensor | None = None
    # A truncating sampler (SamplingParams.truncates): the tokens it kept at each position,
    # compactly. kept_counts [N, L] int32 is how many (0 on padding); kept_ids [K] int32 are
    # the ids, position by position in row-major order (row 0's positions, then row 1's),
    # ascending within a position; K = kept_counts.sum(). None when nothing was truncated.
    kept_counts: Tensor | None = None
    kept_ids: Tensor | None = None

    @property
    def num_sequences(self) -> int:
        return self.response_ids.shape[0]

    @property
    def response_lengths(self) -> Tensor:  # [N] int64
        return self.response_mask.sum(dim=1)

    def sequence_ids(self) -> Tensor:  # [N, P + L] int64: prompt then response, one row each
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    def sequence_mask(self) -> Tensor:  # [N, P + L] bool: real tokens of prompt and response
        return torch.cat([self.prompt_mask, self.response_mask], dim=1)

    def to(self, device: torch.device | str) -> "RolloutBatch":
        """The batch with its tensors on `device` (itself where they are there already): a
        vLLM or Ray engine's batch arrives on the CPU, the learner may train elsewhere."""
        device = torch.device(device)
        if self.response_ids.device == device:
            return self
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return RolloutBatch(
            prompt_ids=move(self.prompt_ids), prompt_mask=move(self.prompt_mask),
            response_ids=move(self.response_ids), response_mask=move(self.response_mask),
            rollout_logp=move(self.rollout_logp), finish_reasons=list(self.finish_reasons),
            routed_experts=move(self.routed_experts), kept_counts=move(self.kept_counts),
            kept_ids=move(self.kept_ids))

    def select(self, index: Tensor) -> "RolloutBatch":
        """Rows `index` ([K] int64) of the batch, in that order."""
        rows = index.tolist()
        counts, ids = None, None
        if self.kept_counts is not None:
            counts = self.kept_counts[index]
            per_row = self.kept_counts.sum(dim=1, dtype=torch.long)  # [N]
            starts = torch.cumsum(per_row, 0) - per_row  # [N] each row's first id
            sizes = per_row[index]  # [K]
            # the ids of row index[k] are kept_ids[starts[index[k]] : + sizes[k]]
            first = torch.repeat_interleave(starts[index] - (torch.cumsum(sizes, 0) - sizes),
                                            sizes)
            ids = self.kept_ids[first + torch.arange(int(sizes.sum()), device=first.device)]
        return RolloutBatch(
            prompt_ids=self.prompt_ids[index],
            prompt_mask=self.prompt_mask[index],
            response_ids=self.response_ids[index],
            response_mask=self.response_mask[index],
            rollout_logp=self.rollout_logp[index],
            finish_reasons=[self.finish_reasons[i] for i in rows],
            routed_experts=None if self.routed_experts is None else self.routed_experts[index],
            kept_counts=counts, kept_ids=ids,
        )

    def without_kept(self) -> "RolloutBatch":
        """The batch without its kept sets (the learner then scores the whole vocabulary)."""
        return replace(self, kept_counts=None, kept_ids=None)

    def kept_starts(self) -> Tensor:
        """[N, L] int64: where each position's kept ids start in `kept_ids` (an exclusive
        running sum of kept_counts in row-major order)."""
        counts = self.kept_counts.long().flatten()
        return (torch.cumsum(counts, 0) - counts).view(self.kept_counts.shape)

    def kept_mask(self, rows: Tensor, column: int, vocab: int,
                  starts: Tensor | None = None) -> Tensor:
        """[B, vocab] bool: True on the tokens the sampler kept at response column `column` of
        rows `rows` ([B] int64). A position with no record (padding) keeps every token.
        `starts`: `kept_starts()`, computed once by a caller that asks column by column."""
        starts = self.kept_starts() if starts is None else starts
        return kept_rows_mask(self.kept_ids, starts[rows, column],
                              self.kept_counts[rows, column].long(), vocab)

    def kept_token_mask(self, vocab: int) -> Tensor:
        """[T, vocab] bool for the T real response tokens in row-major order (the order of
        `response_ids[response_mask]`): True on the tokens kept at each."""
        mask = self.response_mask
        return kept_rows_mask(self.kept_ids, self.kept_starts()[mask],
                              self.kept_counts.long()[mask], vocab)


def kept_rows_mask(ids: Tensor, starts: Tensor, counts: Tensor, vocab: int) -> Tensor:
    """[B, vocab] bool from B segments of `ids` (segment b: ids[starts[b] : + counts[b]]);
    a segment of length 0 keeps every token."""
    B = starts.numel()
    mask = torch.zeros(B, vocab, dtype=torch.bool, device=ids.device)
    total = int(counts.sum())
    if total:
        owner = torch.repeat_interleave(torch.arange(B, device=ids.device), counts)  # [total]
        offset = torch.arange(total, device=ids.device) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts)
        mask[owner, ids[starts[owner] + offset].long()] = True
    return mask | (counts == 0)[:, None]


def concat_batches(batches: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """The rows of `batches` in order, as one batch: prompts left-padded and responses
    right-padded (with `pad_id`, mask False, logprob 0) to the widest of them; MoE
    `routed_experts` padded alike with -1, kept sets with empty positions (all batches have
    them, or none)."""
    P = max(b.prompt_ids.shape[1] for b in batches)
    L = max(b.response_ids.shape[1] for b in batches)
    routed = [b.routed_experts for b in batches]
    if any(r is None for r in routed) != all(r is None for r in routed):
        raise ValueError("concat_batches: some batches have routed_experts and some do not; "
                         "every engine of a MoE model records its experts")
    recorded = [b.kept_counts is not None for b in batches]
    if any(recorded) != all(recorded):
        raise ValueError("concat_batches: some batches have kept sets and some do not; every "
                         "engine of a truncating sampler records them")
    kept = True if all(recorded) else None

    def pad(x, width, value, left):
        extra = width - x.shape[1]
        filler = torch.full((x.shape[0], extra, *x.shape[2:]), value, dtype=x.dtype,
                            device=x.device)
        return torch.cat([filler, x] if left else [x, filler], dim=1)

    def pad_routed(b: RolloutBatch) -> Tensor:  # [n, P_b + L_b, m, k] -> [n, P + L, m, k]
        p = b.prompt_ids.shape[1]
        prompt, response = b.routed_experts[:, :p], b.routed_experts[:, p:]
        return torch.cat([pad(prompt, P, -1, True), pad(response, L, -1, False)], dim=1)

    return RolloutBatch(
        prompt_ids=torch.cat([pad(b.prompt_ids, P, pad_id, True) for b in batches]),
        prompt_mask=torch.cat([pad(b.prompt_mask, P, False, True) for b in batches]),
        response_ids=torch.cat([pad(b.response_ids, L, pad_id, False) for b in batches]),
        response_mask=torch.cat([pad(b.response_mask, L, False, False) for b in batches]),
        rollout_logp=torch.cat([pad(b.rollout_logp, L, 0.0, False) for b in batches]),
        finish_reasons=[r for b in batches for r in b.finish_reasons],
        routed_experts=None if routed[0] is None else torch.cat([pad_routed(b) for b in batches]),
        kept_counts=None if kept is None else torch.cat(
            [pad(b.kept_counts, L, 0, False) for b in batches]),
        kept_ids=None if kept is None else torch.cat([b.kept_ids for b in batches]),
    )
