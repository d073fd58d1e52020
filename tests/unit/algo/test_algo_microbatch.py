"""Micro-batch invariance: with whole-step counts passed in, the summed gradient of the
micro-batches equals the gradient of the whole batch (float32, within 1e-6)."""

import pytest
import torch

from qarl.algo import AGGREGATIONS, LOSSES, apply_corrections, global_counts

N, L, MAX_NEW = 8, 7, 7
SPLITS = [(0, 3), (3, 5), (5, 8)]


def _batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([7, 3, 5, 1, 6, 2, 7, 4])
    mask = torch.arange(L)[None, :] < lengths[:, None]  # [N, L]
    old = -torch.rand(N, L, generator=g) * 3
    # log-ratios up to ±0.3 (token clip active) and ±1e-3 on some rows (sequence clip active)
    logp = old + (torch.rand(N, L, generator=g) - 0.5) * 0.6
    logp[::2] = old[::2] + (torch.rand(N // 2, L, generator=g) - 0.5) * 2e-3
    # sequence mismatch: rows 1 and 6 leave the TBPO band [0.5, 2]
    shift = torch.tensor([0.1, 1.0, -0.2, 0.05, 0.3, -0.1, -0.9, 0.0])
    rollout = old - shift[:, None] + (torch.rand(N, L, generator=g) - 0.5) * 0.1
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 1.0, -1.0])
    return logp, old, rollout, adv, mask


def _grad(name, logp, old, rollout, adv, mask, weights, rows, counts, trim, **params):
    """Sum of micro-batch losses' gradient w.r.t. logp, rows split as given."""
    leaf = logp.clone().requires_grad_(True)
    total = 0.0
    for a, b in rows:
        width = int(mask[a:b].sum(1).max()) if trim else L  # micro-batches padded differently
        sl = (slice(a, b), slice(0, width))
        loss, _ = LOSSES[name](
            leaf[sl], old[sl], rollout[sl], adv[a:b], mask[sl], is_weights=weights[sl],
            **counts, **params,
        )
        total = total + loss
    total.backward()
    return leaf.grad


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_split_equals_whole(name, aggregation):
    """Whole batch (local counts) vs three micro-batches of uneven size and padding width
    (global counts, norm_len fixed, a token-level correction applied): same gradient."""
    logp, old, rollout, adv, mask = _batch()
    corr = apply_corrections({"mis_token": {"low": 0.8, "high": 1.25}}, old, rollout, mask)
    mask_c = corr.mask > 0
    params = {"aggregation": aggregation, "norm_len": MAX_NEW}
    counts = global_counts(name, old, rollout, mask_c, **params)
    inputs = (name, logp, old, rollout, adv, mask_c, corr.weights)
    whole = _grad(*inputs, [(0, N)], {}, False, **params)
    split = _grad(*inputs, SPLITS, counts, True, **params)
    assert whole.abs().max() > 0
    torch.testing.assert_close(split, whole, rtol=0, atol=1e-6)


def test_tbpo_counts_exclude_band_dropped_sequences():
    """global_counts for tbpo removes the two out-of-band rows (1 and 6) from S and T."""
    _, old, rollout, _, mask = _batch()
    counts = global_counts("tbpo", old, rollout, mask)
    assert counts["num_seqs"].item() == N - 2
    assert counts["num_tokens"].item() == mask.sum().item() - 3 - 7
    assert global_counts("grpo", old, rollout, mask)["num_seqs"].item() == N
