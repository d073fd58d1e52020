"""The config checks against the real registries of qarl.algo, qarl.tasks, qarl.quant and the
model zoo."""

from __future__ import annotations

import pytest

from qarl.config import ConfigError, load_config, packaged_recipes


@pytest.mark.parametrize("name", packaged_recipes())
def test_packaged_recipes_pass_real_checks(name):
    """Every packaged recipe names a scheme, loss, task and model that really exist."""
    assert load_config(name).run.name == name


def test_compare_arm_three_correction_exists():
    """The correction named by compare.toml's arm 3 exists."""
    assert load_config("compare", ["--algo.correction=tis_token"]).algo.correction == "tis_token"


@pytest.mark.parametrize("overrides, fragment", [
    (["--algo.loss=tpbo"], "algo.loss: unknown loss 'tpbo'; did you mean 'tbpo'?"),
    (["--algo.loss_params.eps_hihg=1e-3"], "did you mean 'eps_high'?"),
    (["--algo.loss_params.band_low=3", "--algo.loss_params.band_high=2"], "algo.loss_params: "),
    (["--algo.correction=tis_tokn"], "did you mean 'tis_token'?"),
    (["--algo.correction=tis_token", "--algo.correction_params.cap=0.5"], "cap must be >= 1"),
    (["--algo.aggregation=token-maen"], "did you mean 'token-mean'?"),
    (["--task.options.digts=2"], "task.options.digts: unknown parameter 'digts'"),
    (["--task.name=additon"], "did you mean 'addition'?"),
    (["--task.reward=math_anser"], "did you mean 'math_answer'?"),
    (["--model.name=smollm2"], "model.name: 'smollm2' is neither a zoo model"),
])
def test_real_registry_messages(overrides, fragment):
    """Names and parameters are checked against the real registries, with suggestions."""
    with pytest.raises(ConfigError) as caught:
        load_config("tiny", overrides)
    assert fragment in str(caught.value)


def test_real_scheme_names():
    """quant.scheme is checked against qarl.quant.SCHEMES, which holds 'none' (full precision)."""
    assert load_config("tiny", ["--quant.scheme=none"]).quant.scheme == "none"
    with pytest.raises(ConfigError, match="quant.scheme: unknown scheme 'w8a8-int9'"):
        load_config("tiny", ["--quant.scheme=w8a8-int9"])
