"""KL estimators between the policy and a reference policy, per token (verl's `kl_penalty`).

With d = logp − ref_logp for a token sampled from the policy, each estimator's expectation
under the policy approximates KL(π_θ ‖ π_ref) (J. Schulman, "Approximating KL divergence"):

    k1   d                                  unbiased, high variance, can be negative
    abs  |d|
    k2   ½·d²                               biased, low variance; gradient d·∇logp
    k3   exp(−d) + d − 1 = ratio − log ratio − 1,  ratio = π_ref / π_θ = exp(ref_logp − logp)
                                            unbiased, low variance, ≥ 0

Gradients flow through `logp` (and through `ref_logp` if it carries one; a reference is
normally computed without grad). k3's gradient with respect to logp is 1 − exp(ref_logp −
logp). verl clamps k3 for numerical safety and so does this module: the log ratio
ref_logp − logp to ±20 before exp, the result to ±10; a clamped value has gradient 0.
As a loss term on the policy's own samples, the expected gradient is 0 for k1,
∇KL(π_θ ‖ π_ref) for k2 and ∇KL(π_ref ‖ π_θ) for k3 (Σ_y π_θ·(1 − π_ref/π_θ)·∇logp(y)).

`kl_terms` returns the per-token values, 0 on masked positions; how they are reduced to a
loss or folded into the reward is the caller's (aggregation.py reduces a per-token loss).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qarl.algo.common import UnknownNameError, as_valid, masked_log_ratio

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")
# verl's other names for the same estimators, named in the error for a recipe written for it
VERL_NAMES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
# verl's bounds on k3: the log ratio before exp, then the estimate
K3_LOG_RATIO_BOUND = 20.0
K3_VALUE_BOUND = 10.0


def kl_terms(
    logp: Tensor,  # [N, L] float, the policy's logprobs of the sampled tokens (with grad)
    ref_logp: Tensor,  # [N, L] float, the reference policy's logprobs of the same tokens
    mask: Tensor | None = None,  # [N, L] bool or 0/1; None = every position
    *,
    estimator: str,
) -> Tensor:  # [N, L] in logp's dtype, 0 where masked
    """Per-token KL estimate `estimator` (one of KL_ESTIMATORS) of π_θ against π_ref."""
    if estimator not in KL_ESTIMATORS:
        hint = (f" (verl's {estimator!r} is {VERL_NAMES[estimator]!r} here)"
                if estimator in VERL_NAMES else "")
        raise UnknownNameError(f"unknown KL estimator {estimator!r}{hint}; valid names: "
                               f"{', '.join(sorted(KL_ESTIMATORS))}")
    if logp.shape != ref_logp.shape or (mask is not None and mask.shape != logp.shape):
        raise ValueError(
            f"logp, ref_logp and mask must have one shape [N, L]; got {tuple(logp.shape)}, "
            f"{tuple(ref_logp.shape)}, {None if mask is None else tuple(mask.shape)}"
        )
    valid = torch.ones_like(logp, dtype=torch.bool) if mask is None else as_valid(mask)
    # d = logp − ref_logp, 0 off the mask (padding may hold −inf), so every estimator is 0 there
    d = masked_log_ratio(logp, ref_logp, valid)  # [N, L]
    if estimator == "k1":
        return d
    if estimator == "abs":
        return d.abs()
    if estimator == "k2":
        # ½·(logp − ref_logp)²
        return 0.5 * d.square()
    # x = clamp(ref_logp − logp, ±20);  k3 = clamp(exp(x) − x − 1, ±10)
    x = (-d).clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)  # [N, L]
    return (torch.exp(x) - x - 1.0).clamp(-K3_VALUE_BOUND, K3_VALUE_BOUND)
