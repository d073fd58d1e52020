"""Registries and parameter validation: unknown names list the valid ones; nonsense values
raise clearly, all problems at once."""

import pytest
import torch

from qarl.algo import (
    CORRECTIONS,
    LOSSES,
    UnknownNameError,
    correction_params,
    loss_params,
    metrics_to_floats,
    validate_correction_params,
    validate_loss_params,
)


def test_unknown_loss_lists_sorted_names():
    """LOSSES['nope'] raises a KeyError (also a ValueError) naming every loss, sorted."""
    with pytest.raises(KeyError, match="dapo, dr_grpo, dual_clip, grpo, gspo, tbpo"):
        LOSSES["nope"]
    with pytest.raises(ValueError):
        validate_loss_params("nope", {})


def test_unknown_correction_lists_sorted_names():
    """CORRECTIONS['nope'] names every correction, sorted."""
    names = "geo_mask, mis_seq, mis_token, opsm, tis_seq, tis_token"
    with pytest.raises(UnknownNameError, match=names):
        CORRECTIONS["nope"]


def test_tbpo_defaults_are_the_method_values():
    """The recipe-settable TBPO parameters and defaults are those of method.md §3."""
    assert loss_params("tbpo") == {
        "eps_low": 3e-4, "eps_high": 4e-4, "neg_eps_low": 3e-4, "neg_eps_high": 7e-4,
        "is_cap": 2.0, "band_low": 0.5, "band_high": 2.0,
        "aggregation": "seq-mean-token-mean", "norm_len": None,
    }
    dapo = loss_params("dapo")
    assert dapo["eps_low"] == 0.2 and dapo["eps_high"] == 0.28
    assert dapo["aggregation"] == "token-mean"
    assert loss_params("dual_clip")["clip_c"] == 3.0
    assert correction_params("tis_token") == {"cap": 2.0}


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_takes_aggregation_and_norm_len(name):
    """Every loss accepts `aggregation` and `norm_len`: the trainer passes algo.aggregation and
    the response budget to whichever loss a recipe names."""
    assert {"aggregation", "norm_len"} <= set(loss_params(name))


def test_validate_reports_every_problem_at_once():
    """Unknown key, negative eps, band_low > band_high and cap < 1 all appear in one error."""
    with pytest.raises(ValueError) as err:
        validate_loss_params(
            "tbpo", {"eps_lo": 0.1, "eps_high": -0.1, "band_low": 3.0, "is_cap": 0.5}
        )
    text = str(err.value)
    fragments = (
        "'eps_lo'", "eps_high must be", "band_low (3.0) must be <= band_high", "is_cap must be >= 1"
    )
    for fragment in fragments:
        assert fragment in text, fragment


def test_validate_returns_merged_params():
    """A valid override comes back merged with the defaults."""
    full = validate_loss_params("grpo", {"eps_high": 0.3})
    assert full == {
        "eps_low": 0.2, "eps_high": 0.3, "aggregation": "seq-mean-token-mean", "norm_len": None
    }


@pytest.mark.parametrize(
    "name, params, fragment",
    [
        ("tis_token", {"cap": 0.9}, "cap must be >= 1"),
        ("mis_token", {"low": 2.0, "high": 1.0}, "low (2.0) must be <= high"),
        ("tis_seq", {"form": "arithmetic"}, "form must be"),
        ("opsm", {"delta": -1.0}, "delta must be"),
    ],
)
def test_correction_params_that_make_no_sense(name, params, fragment):
    """Bad correction parameters raise from validation and from the call itself."""
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        validate_correction_params(name, params)
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        CORRECTIONS[name](x, x, x > -1, torch.ones(1), **params)


@pytest.mark.parametrize(
    "name, params",
    [
        ("grpo", {"eps_low": -0.1}),
        ("gspo", {"eps_high": -1e-4}),
        ("dual_clip", {"clip_c": 1.1}),  # <= 1 + eps_high: cuts inside the clip range
        ("tbpo", {"band_low": 2.5}),
        ("tbpo", {"is_cap": 0.5}),
        ("dapo", {"aggregation": "token-sum"}),
    ],
)
def test_loss_call_rejects_nonsense(name, params):
    """Calling a loss directly with a nonsense parameter raises ValueError before any math."""
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError):
        LOSSES[name](x, x, x, torch.ones(1), x > -1, **params)


def test_metrics_are_detached_scalars():
    """Every metric is a 0-d tensor without grad; metrics_to_floats gives plain floats."""
    logp = torch.zeros(2, 3, requires_grad=True)
    x = torch.zeros(2, 3)
    _, metrics = LOSSES["tbpo"](logp, x, x, torch.tensor([1.0, -1.0]), x > -1)
    assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())
    floats = metrics_to_floats(metrics)
    assert all(type(v) is float for v in floats.values()) and floats.keys() == metrics.keys()
