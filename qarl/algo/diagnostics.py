"""Mismatch and error-token diagnostics (method.md §5): pure functions, floats out.

Inputs follow `RolloutBatch`: response tensors are [N, L], right-padded, real tokens from
column 0, `mask` [N, L] bool/0-1 True on response tokens. Everything works on token ids, so
no tokenizer is needed. Outputs are Python floats (ready for a metrics line); a statistic over
an empty set (no response token, no sequence) is nan rather than a made-up 0.

Mismatch, with d_t = old_logp_t − rollout_logp_t = log r_t, r_t = π_old(y_t) / π_μ(y_t):

    abs_diff_mean / abs_diff_max   mean / max over response tokens of |d_t|
    k3_kl                          mean over response tokens of (r_t − 1) − log r_t
    seq_ratio_mean / min / max     ρ_i = exp(mean_t d_t) over sequences with ≥ 1 token

k3 direction: tokens are sampled from π_μ and E_μ[r − 1] = 0, so E_μ[(r − 1) − log r] =
E_μ[log π_μ − log π_old] = KL(π_μ ‖ π_old): the KL from the sampler to the learner, per token.
Each term is ≥ 0, so the estimate is too (unlike the plain −log r estimator).

Error tokens:

    rep_ngram       fraction of response 4-grams that repeat an earlier 4-gram of the same
                    response (pooled over the batch)
    rep_run         fraction of responses containing ≥ 4 identical consecutive n-grams, n ≤ 3
                    (e.g. "to to to to"; also fires on long digit runs like "10000")
    truncated       fraction of responses whose finish reason is "length"
    lowprob_tokens  fraction of response tokens whose learner probability is < 1e-3
    garbled         fraction of responses that fail the task's grammar (booleans in)

Routing (mixture-of-experts models, `routing_disagreement`): per MoE layer, the fraction of
response tokens whose learner top-k expert set differs from the engine's; `routing_disagree_frac`
is its mean over layers, `routing_disagree_max` the largest layer's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from qarl.algo.common import as_valid
from qarl.types import FINISH_LENGTH

DEFAULT_POSITION_BUCKETS = (0, 16, 64, 256, 1024)
LOWPROB_THRESHOLD = 1e-3

_NAN = float("nan")


def mismatch_metrics(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, float]:
    """Learner-vs-sampler mismatch over response tokens; see the module docstring."""
    valid = as_valid(mask)  # [N, L] bool
    # d = log r = old_logp − rollout_logp, in float64: (r − 1) − log r cancels badly in fp32
    d = (old_logp.double() - rollout_logp.double()).masked_fill(~valid, 0.0)  # [N, L]
    num_tokens = int(valid.sum())
    if num_tokens == 0:
        return dict.fromkeys(
            ("abs_diff_mean", "abs_diff_max", "k3_kl", "seq_ratio_mean", "seq_ratio_min",
             "seq_ratio_max"), _NAN)
    abs_d = d.abs()
    # k3_t = (r_t − 1) − log r_t = expm1(d_t) − d_t
    k3 = (torch.expm1(d) - d).masked_fill(~valid, 0.0)
    lengths = valid.sum(dim=1)  # [N]
    has_tokens = lengths > 0
    # ρ_i = exp(mean_t d_it), over sequences with at least one response token
    rho = torch.exp(d.sum(dim=1)[has_tokens] / lengths[has_tokens])  # [N'] float64
    return {
        "abs_diff_mean": float(abs_d.sum() / num_tokens),
        "abs_diff_max": float(abs_d.max()),
        "k3_kl": float(k3.sum() / num_tokens),
        "seq_ratio_mean": float(rho.mean()),
        "seq_ratio_min": float(rho.min()),
        "seq_ratio_max": float(rho.max()),
    }


def _bucket_names(buckets: Sequence[int]) -> list[str]:
    names = [f"{lo}-{hi - 1}" for lo, hi in zip(buckets[:-1], buckets[1:])]
    return names + [f"{buckets[-1]}+"]


def mismatch_by_position(
    old_logp: Tensor,
    rollout_logp: Tensor,
    mask: Tensor,
    buckets: Sequence[int] = DEFAULT_POSITION_BUCKETS,
) -> dict[str, float]:
    """Mean |old_logp − rollout_logp| per response-position bucket.

    `buckets` are increasing start positions beginning at 0: (0, 16, 64) gives buckets
    "0-15", "16-63" and "64+" (positions count from the first response token). A bucket with
    no response token is nan.
    """
    if len(buckets) == 0 or buckets[0] != 0 or any(b <= a for a, b in zip(buckets, buckets[1:])):
        raise ValueError(
            f"buckets must be strictly increasing start positions beginning at 0, got "
            f"{tuple(buckets)}; e.g. {DEFAULT_POSITION_BUCKETS}"
        )
    valid = as_valid(mask)  # [N, L]
    abs_d = (old_logp.double() - rollout_logp.double()).abs().masked_fill(~valid, 0.0)  # [N, L]
    positions = torch.arange(valid.shape[1])  # [L]
    bucket_of = torch.bucketize(positions, torch.tensor(list(buckets)), right=True) - 1  # [L]
    out = {}
    for index, name in enumerate(_bucket_names(buckets)):
        cols = bucket_of == index  # [L] bool
        count = int(valid[:, cols].sum())
        out[name] = float(abs_d[:, cols].sum() / count) if count else _NAN
    return out


def _ngrams(ids: Tensor, mask: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """All n-grams of each row and whether they lie fully inside the response.

    Returns grams [N, L-n+1, n] int64 and inside [N, L-n+1] bool.
    """
    grams = ids.unfold(1, n, 1)  # [N, L-n+1, n]
    inside = as_valid(mask).unfold(1, n, 1).all(dim=-1)  # [N, L-n+1]
    return grams, inside


def rep_ngram(response_ids: Tensor, mask: Tensor, n: int = 4) -> float:
    """Fraction of response n-grams equal to an earlier n-gram of the same response.

    Per row, the repeats are (n-grams) − (distinct n-grams): every distinct n-gram's first
    occurrence is new and each later one repeats it. nan if no response has n tokens.
    """
    if response_ids.shape[1] < n:
        return _NAN
    grams, inside = _ngrams(response_ids, mask, n)
    rows = torch.arange(grams.shape[0]).unsqueeze(1).expand(inside.shape)  # [N, L-n+1]
    keyed = torch.cat([rows[inside].unsqueeze(1), grams[inside]], dim=1)  # [G, 1 + n]
    total = keyed.shape[0]
    if total == 0:
        return _NAN
    distinct = torch.unique(keyed, dim=0).shape[0]  # distinct (row, n-gram) pairs
    return (total - distinct) / total


def has_repeat_run(
    response_ids: Tensor, mask: Tensor, min_repeats: int = 4, max_n: int = 3
) -> Tensor:
    """[N] bool: the response holds ≥ min_repeats identical consecutive n-grams, some n ≤ max_n.

    k copies of an n-gram back to back are a span of k·n tokens with x[t] = x[t + n] for its
    first (k − 1)·n positions, so we look for (k − 1)·n consecutive such equalities.
    """
    valid = as_valid(mask)  # [N, L]
    found = torch.zeros(response_ids.shape[0], dtype=torch.bool)  # [N]
    for n in range(1, max_n + 1):
        need = (min_repeats - 1) * n
        if response_ids.shape[1] < need + n:
            continue
        # periodic[i, t] = x[i, t] == x[i, t + n], both inside the response   [N, L-n]
        periodic = (response_ids[:, :-n] == response_ids[:, n:]) & valid[:, n:] & valid[:, :-n]
        found |= periodic.unfold(1, need, 1).all(dim=-1).any(dim=1)
    return found


def rep_run(response_ids: Tensor, mask: Tensor, min_repeats: int = 4, max_n: int = 3) -> float:
    """Fraction of responses with a run of ≥ min_repeats identical consecutive n-grams."""
    if response_ids.shape[0] == 0:
        return _NAN
    return float(has_repeat_run(response_ids, mask, min_repeats, max_n).float().mean())


def truncated(finish_reasons: Sequence[str]) -> float:
    """Fraction of responses that stopped at the length limit (finish reason "length")."""
    if not finish_reasons:
        return _NAN
    return sum(r == FINISH_LENGTH for r in finish_reasons) / len(finish_reasons)


def lowprob_tokens(logp: Tensor, mask: Tensor, threshold: float = LOWPROB_THRESHOLD) -> float:
    """Fraction of response tokens whose probability under `logp` ([N, L], the learner's
    log-probability of each sampled token) is below `threshold`."""
    valid = as_valid(mask)
    count = int(valid.sum())
    if count == 0:
        return _NAN
    return int(((logp < math.log(threshold)) & valid).sum()) / count


def garbled(grammar_ok: Sequence[bool]) -> float:
    """Fraction of responses that fail the task grammar (one boolean per response)."""
    if len(grammar_ok) == 0:
        return _NAN
    return sum(not ok for ok in grammar_ok) / len(grammar_ok)


def routing_disagreement(learner: Tensor, engine: Tensor, mask: Tensor) -> dict[str, float]:
    """learner, engine: [N, S, layers, k] expert ids (-1: not recorded) of whole sequences
    (`RolloutBatch.routed_experts`, S = P + L) or of the responses only (S = L); mask [N, L]
    -> the routing disagreement of the module docstring over the response tokens (the last L
    positions) both sides recorded."""
    L = mask.shape[1]
    learner, engine = learner[:, -L:], engine[:, -L:]  # [N, L, layers, k]
    recorded = (learner >= 0).all(-1).all(-1) & (engine >= 0).all(-1).all(-1)  # [N, L]
    valid = as_valid(mask) & recorded
    num_tokens = int(valid.sum())
    if num_tokens == 0:
        return {"routing_disagree_frac": _NAN, "routing_disagree_max": _NAN}
    # the top-k as a set: sorted ids compared slot by slot
    differs = (learner.sort(-1).values != engine.sort(-1).values).any(-1)  # [N, L, layers]
    per_layer = (differs & valid[..., None]).sum(dim=(0, 1)).double() / num_tokens  # [layers]
    return {"routing_disagree_frac": float(per_layer.mean()),
            "routing_disagree_max": float(per_layer.max())}


def error_token_metrics(
    response_ids: Tensor,
    mask: Tensor,
    finish_reasons: Sequence[str],
    learner_logp: Tensor | None = None,
    grammar_ok: Sequence[bool] | None = None,
) -> dict[str, float]:
    """All error-token metrics of a batch: rep_ngram, rep_run, truncated, and
    lowprob_tokens / garbled when their inputs (learner logp, grammar verdicts) are given;
    a metric without its input is left out, never reported as 0."""
    out = {
        "rep_ngram": rep_ngram(response_ids, mask),
        "rep_run": rep_run(response_ids, mask),
        "truncated": truncated(finish_reasons),
    }
    if learner_logp is not None:
        out["lowprob_tokens"] = lowprob_tokens(learner_logp, mask)
    if grammar_ok is not None:
        out["garbled"] = garbled(grammar_ok)
    return out
