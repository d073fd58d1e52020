"""Aggregation modes on a hand-computed 2 x 3 example."""

import pytest
import torch

from qarl.algo import AGGREGATIONS, UnknownNameError, aggregate

# Row 0 has tokens [1, 2, 3]; row 1 has one token [4] and two padding slots.
X = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]], dtype=torch.float64)
MASK = torch.tensor([[True, True, True], [True, False, False]])


@pytest.mark.parametrize(
    "mode, kwargs, expected",
    [
        ("token-mean", {}, 10 / 4),  # (1+2+3+4) / 4 tokens
        ("seq-mean-token-mean", {}, (6 / 3 + 4 / 1) / 2),  # (mean 2, mean 4) / 2 rows
        ("seq-mean-token-sum", {}, (6 + 4) / 2),
        ("seq-mean-token-sum-norm", {"norm_len": 5}, 10 / (2 * 5)),
        ("seq-mean-token-sum-norm", {}, 10 / (2 * 3)),  # default norm_len = padded width L = 3
        ("token-mean", {"num_tokens": 8}, 10 / 8),  # a global count replaces the local one
        ("seq-mean-token-mean", {"num_seqs": torch.tensor(4.0)}, 6 / 4),
    ],
)
def test_modes_match_hand_values(mode, kwargs, expected):
    """Each mode gives its hand-computed value; NaN/inf on padding never leaks into the result."""
    assert aggregate(X, MASK, mode, **kwargs).item() == pytest.approx(expected, abs=1e-12)


def test_rows_without_tokens_are_not_counted():
    """A row whose mask is all zero adds nothing and is not counted in S."""
    mask = torch.cat([MASK, torch.zeros(1, 3, dtype=torch.bool)])
    x = torch.cat([X, torch.ones(1, 3, dtype=torch.float64)])
    assert aggregate(x, mask, "seq-mean-token-sum").item() == pytest.approx(5.0, abs=1e-12)


def test_unknown_mode_lists_valid_names():
    """An unknown mode raises with every valid name, sorted."""
    with pytest.raises(UnknownNameError, match=", ".join(sorted(AGGREGATIONS))):
        aggregate(X, MASK, "token-sum")
