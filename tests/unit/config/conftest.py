"""Fixtures for the config tests: stand-in registries, a minimal valid recipe.

The stand-ins mirror the real registries' shapes (a dict of names; `loss_params(name)` ->
{param: default}; `validate_*(name, params)` raising ValueError) so the config checks are
tested without importing torch; test_config_registries.py checks against the real ones.
"""

from __future__ import annotations

import pytest

import qarl.config.checks as checks

BASE_TOML = """\
[task]
name = "addition"

[train]
steps = 2
lr = 1e-4
"""

_LOSS_PARAMS = {
    "tbpo": {"eps_low": 3e-4, "eps_high": 4e-4, "is_cap": 2.0,
             "aggregation": "seq-mean-token-mean"},
    "grpo": {"eps_low": 0.2, "eps_high": 0.2, "aggregation": "token-mean"},
    "gspo": {"eps_low": 3e-4, "eps_high": 4e-4},
}


def _validate_loss_params(name, params):
    if params.get("eps_low", 0) >= 1:
        raise ValueError(f"invalid parameters for loss {name!r}: eps_low must be in [0, 1)")


def _scheme_int4(group_size: int = 128):
    return group_size


FAKE_REGISTRIES = {
    ("qarl.algo", "LOSSES"): dict.fromkeys(_LOSS_PARAMS),
    ("qarl.algo", "loss_params"): _LOSS_PARAMS.__getitem__,
    ("qarl.algo", "validate_loss_params"): _validate_loss_params,
    ("qarl.algo", "AGGREGATIONS"): ("token-mean", "seq-mean-token-mean"),
    ("qarl.algo", "CORRECTIONS"): {"tis_token": None, "mis_seq": None},
    ("qarl.algo", "correction_params"): {"tis_token": {"cap": 2.0},
                                         "mis_seq": {"low": 0.5, "high": 2.0}}.__getitem__,
    ("qarl.tasks", "TASKS"): {"addition": None, "dataset": None},
    ("qarl.tasks", "task_options"): {"addition": {"digits": 1},
                                     "dataset": {"path": "", "reward": "", "eval_fraction": 0.1}
                                     }.__getitem__,
    ("qarl.tasks", "REWARDS"): {"addition": None, "math_answer": None},
    ("qarl.quant", "SCHEMES"): {"w8a8-int8": object(), "w4a16-int4": _scheme_int4},
    ("qarl.model.zoo", "ZOO"): {"tiny": None, "smollm2-135m": None},
}


@pytest.fixture
def fake_registries(monkeypatch):
    """Replace the lazy registry lookup of qarl.config.checks by FAKE_REGISTRIES."""
    monkeypatch.setattr(checks, "registry",
                        lambda module, name: FAKE_REGISTRIES.get((module, name)))
    return FAKE_REGISTRIES


@pytest.fixture
def base_toml():
    """A minimal valid recipe (a built-in task and the two required train keys)."""
    return BASE_TOML


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(text, name='recipe') -> path of a TOML file holding `text`."""
    def write(text: str, name: str = "recipe") -> str:
        path = tmp_path / f"{name}.toml"
        path.write_text(text, encoding="utf-8")
        return str(path)

    return write
