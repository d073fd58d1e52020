"""Logits -> tokens and their log-probabilities: the one place the sampler's math lives.

`token_logprobs` is the function the learner calls to recompute logprobs, and the engine calls
the very same function on the logits it sampled from, so learner and sampler logprobs agree
bit for bit whenever their logits do.

What `sample` reports as the sampler logprob of each drawn token:
- sampling (temperature T, optional top-k, then top-p, then min-p): the log-probability under
  exactly the distribution that was drawn from, softmax(logits / T) restricted to the kept
  tokens and renormalized. Without truncation this is `token_logprobs(logits, tokens, T)`.
  With truncation `sample` also returns which tokens it kept ([B, V] bool), which the engine
  records in the batch; `kept_logprobs` scores tokens under a recorded kept set: the
  sampler's own value, bit for bit, for the logits the sampler had, and the learner's view of
  the same truncated distribution for its own logits (docs/learner.md).
- greedy: `token_logprobs(logits, tokens, 1.0)`, the log-softmax of the raw logits (the
  argmax "distribution" would give 0 everywhere, which says nothing about the policy).
Everything is computed in float32 whatever the model dtype (bf16 logits are upcast first).

Randomness is per response (`row_uniforms`): row r of a `generate(..., seed)` call draws its
step-t token with the t-th uniform of a stream seeded from (seed, r), so splitting a batch
over engines (`qarl.parallel.RayEngines`) samples exactly the tokens of one engine.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qarl import native
from qarl.types import SamplingParams

_MASK64 = (1 << 64) - 1


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of `tokens` under softmax(logits / temperature), in float32.

    logits: [..., V] any float dtype; tokens: [...] int64 -> [...] float32.
    Only the chosen token is gathered: no log-softmax over the vocabulary is kept. For an
    fp32 input at temperature 1 no copy of `logits` is made.
    """
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature if scaled is logits else scaled.div_(temperature)
    # log p(y) = z_y / T - logsumexp(z / T)
    picked = scaled.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [...]
    return picked - torch.logsumexp(scaled, dim=-1)


def truncate_logits(scaled: Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> Tensor:
    """Set logits outside the top-k, then outside the top-p nucleus, then below min-p, to -inf.

    scaled: [B, V] float32 (already divided by the temperature) -> [B, V] float32.
    top_k keeps every token whose logit is >= the k-th largest (ties at the k-th value are
    all kept). top_p keeps the smallest prefix of the sorted distribution whose mass reaches
    top_p: token i is kept when the mass of the tokens ranked before it is < top_p, so the
    most likely token is always kept. min_p keeps the tokens whose probability is at least
    min_p times the most likely token's: p_i >= min_p p_max, i.e. z_i >= z_max + log(min_p)
    (a ratio of probabilities, the same before and after renormalizing).
    """
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # [B, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)  # [B, V] each
        probs = torch.softmax(sorted_logits, dim=-1)
        # mass strictly before rank i: cumsum_i - p_i
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # [B, V] bool, in rank order
        drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)  # vocab order
        scaled = scaled.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        # p_i >= min_p * p_max  <=>  z_i - z_max >= log(min_p)
        floor = scaled.amax(dim=-1, keepdim=True) + math.log(min_p)  # [B, 1]
        scaled = scaled.masked_fill(scaled < floor, float("-inf"))
    return scaled


def truncated(logits: Tensor, sampling: SamplingParams) -> Tensor:
    """softmax's input of the truncating sampler: logits / T with every token it does not keep
    at -inf ([B, V] float32)."""
    return truncate_logits(logits.float() / sampling.temperature, sampling.top_k,
                           sampling.top_p, sampling.min_p)


def kept_logprobs(logits: Tensor, tokens: Tensor, temperature: float, kept: Tensor) -> Tensor:
    """Log-probability of `tokens` under softmax(logits / T) restricted to `kept` ([B, V] bool,
    a recorded kept set) and renormalized: [B] float32. For the logits the sampler had and the
    set it kept, the very tensor `sample` took its logprob from (the same division, the same
    -inf), hence the same bits. Gradients reach the kept tokens' logits only."""
    scaled = (logits.float() / temperature).masked_fill(~kept, float("-inf"))
    return token_logprobs(scaled, tokens, 1.0)


def sampler_logprobs(logits: Tensor, tokens: Tensor, sampling: SamplingParams) -> Tensor:
    """Log-probability of given `tokens` ([B] int64) under the distribution `sample` draws
    from with these settings (see the module docstring): [B] float32. `sample` reports
    exactly this for the tokens it draws; `LocalEngine.score` calls it for forced tokens."""
    if sampling.greedy:
        return token_logprobs(logits, tokens, 1.0)
    if sampling.truncates:
        return token_logprobs(truncated(logits, sampling), tokens, 1.0)
    return token_logprobs(logits, tokens, sampling.temperature)


def inverse_cdf(logits: Tensor, u: Tensor, temperature: float = 1.0) -> Tensor:
    """One draw per row from softmax(logits / temperature): the first token whose cumulative
    probability exceeds u * total. logits: [B, V] float32 (-inf where truncated); u: [B]
    float64 uniforms in [0, 1) -> [B] int64.

    One uniform per row instead of Gumbel-max's one exponential per vocabulary entry (batch x
    vocabulary draws per step from PyTorch's CPU generator):
    qarl.native's one-pass kernel where it runs (it divides by the temperature itself, the same
    fp32 division), else the same method in PyTorch ops (fp64 cumulative sums). The two agree
    except where a cumulative sum lands within rounding of u * total, so a seed's draws can
    differ in rare tokens between the two paths."""
    if native.available() and logits.is_cpu:
        return native.sample_rows(logits.float().contiguous(), temperature, u)
    scaled = logits.float() / temperature
    probs = (scaled - scaled.amax(dim=-1, keepdim=True)).exp()  # [B, V], exactly 0 at -inf
    cum = probs.cumsum(dim=-1, dtype=torch.float64)  # [B, V]
    target = (u.to(cum.device) * cum[:, -1])[:, None]  # [B, 1]
    tokens = torch.searchsorted(cum, target, right=True)[:, 0]  # first cum > target
    # u * total can round up to the total: the last token with mass
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.minimum(tokens, last)


def row_seed(seed: int, row: int) -> int:
    """The seed of one response's random stream: a 64-bit mix (splitmix64's finalizer) of the
    call's seed and the row's index in the whole batch, so a row draws the same numbers
    whichever engine, shard or batch position it lands in."""
    z = (seed * 0x9E3779B97F4A7C15 + row + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1  # 63 bits: torch.Generator seeds are signed int64


def row_uniforms(seed: int, first_row: int, num_rows: int, steps: int) -> Tensor:
    """The uniforms of rows first_row .. first_row + num_rows - 1 for `steps` decode steps:
    [num_rows, steps] float64 in [0, 1), row r's from its own generator seeded with
    `row_seed(seed, r)`. A row's draws depend on (seed, r) only: not on the other rows, the
    batch size or the step at which the batch was compacted."""
    out = torch.empty(num_rows, steps, dtype=torch.float64)
    for i in range(num_rows):
        generator = torch.Generator().manual_seed(row_seed(seed, first_row + i))
        torch.rand(steps, generator=generator, dtype=torch.float64, out=out[i])
    return out


def sample(logits: Tensor, sampling: SamplingParams,
           u: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """Draw one token per row and report its sampler logprob (see the module docstring).

    logits: [B, V] any float dtype; u: [B] float64, the rows' uniforms in [0, 1) (unused when
    greedy) -> (tokens [B] int64, logp [B] float32, kept [B, V] bool or None): kept is the set
    drawn from when the sampler truncates (`SamplingParams.truncates`), else None. The
    uniforms are the only randomness.
    """
    if sampling.greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, token_logprobs(logits, tokens, 1.0), None
    if sampling.truncates:
        scaled = truncated(logits, sampling)  # [B, V] float32
        tokens = inverse_cdf(scaled, u)
        return tokens, token_logprobs(scaled, tokens, 1.0), scaled != float("-inf")
    tokens = inverse_cdf(logits, u, sampling.temperature)
    # The learner's exact computation: same function, same logits, same temperature.
    return tokens, token_logprobs(logits, tokens, sampling.temperature), None
