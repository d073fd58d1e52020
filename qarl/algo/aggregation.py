"""How a per-token loss matrix becomes one scalar: the four aggregation modes.

Every loss in `qarl.algo` produces a per-token loss `x [N, L]` (sequence-level losses repeat
the sequence's loss on each of its tokens) and a 0/1 mask of the tokens that count, then calls
`aggregate`. With `n_i = Σ_t m_it` the token count of row i:

    token-mean                Σ_it m·x / T                   T = Σ_it m  (tokens in the batch)
    seq-mean-token-mean       Σ_i (Σ_t m·x / n_i) / S        S = #{i : n_i > 0}
    seq-mean-token-sum        Σ_it m·x / S
    seq-mean-token-sum-norm   Σ_it m·x / (S · norm_len)      norm_len: a constant (Dr.GRPO)

Micro-batch contract. T and S default to the counts of the tensors passed in, which makes the
loss depend on how an optimizer step's batch is split. To make the summed gradient of the
micro-batches equal the gradient of the whole batch, pass `num_tokens = T` and `num_seqs = S`
computed once over the whole step's batch (after corrections and the TBPO band have removed
tokens and sequences: `qarl.algo.global_counts` does that), and `norm_len` as a constant
(`max_new_tokens`): its default `L` is the padded width of the tensor passed in, which changes
between micro-batches. Then sum (do not average) the micro-batch losses. Each numerator term
depends on one row only, so the sum over micro-batches is the whole-batch numerator.
A row with no counted token contributes 0 and is not counted in S.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qarl.algo.common import UnknownNameError

AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def count_tokens_and_seqs(valid: Tensor) -> tuple[Tensor, Tensor]:
    """(T, S) of a bool mask [N, L]: counted tokens, and rows with at least one of them."""
    return valid.sum().float(), valid.any(dim=1).sum().float()


def _denominator(count: Tensor | float | int | None, fallback: Tensor, like: Tensor) -> Tensor:
    value = fallback if count is None else torch.as_tensor(count, device=like.device)
    return value.to(like.dtype).clamp_min(1.0)


def aggregate(
    per_token: Tensor,  # [N, L] float, the loss of each token
    valid: Tensor,  # [N, L] bool, tokens that count
    mode: str,
    num_tokens: Tensor | float | int | None = None,  # T over the whole step's batch
    num_seqs: Tensor | float | int | None = None,  # S over the whole step's batch
    norm_len: int | None = None,  # constant of seq-mean-token-sum-norm; default L
) -> Tensor:  # [] float
    """One scalar from a per-token loss; see the module docstring for the modes and contract."""
    if mode not in AGGREGATIONS:
        raise UnknownNameError(
            f"unknown aggregation {mode!r}; valid names: {', '.join(sorted(AGGREGATIONS))}"
        )
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    # Masked positions may hold inf/NaN (padding); where() keeps them out of sums and grads.
    x = torch.where(valid, per_token, zero)  # [N, L]
    local_t, local_s = count_tokens_and_seqs(valid)
    if mode == "token-mean":
        # Σ_it m·x / T
        return x.sum() / _denominator(num_tokens, local_t, x)
    seqs = _denominator(num_seqs, local_s, x)
    if mode == "seq-mean-token-mean":
        # Σ_i (Σ_t m·x / n_i) / S
        n_i = valid.sum(dim=1).clamp_min(1).to(x.dtype)  # [N]
        return (x.sum(dim=1) / n_i).sum() / seqs
    if mode == "seq-mean-token-sum":
        # Σ_it m·x / S
        return x.sum() / seqs
    # Σ_it m·x / (S · norm_len)
    length = per_token.shape[1] if norm_len is None else norm_len
    return x.sum() / (seqs * max(int(length), 1))
