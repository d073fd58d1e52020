"""train.async_rollouts and train.async_staleness: what loads, and what is refused at config
load (every problem at once, each naming the key and the fix)."""

from __future__ import annotations

import pytest

from qarl.config import ConfigError, load_config


def _problems(base_toml, write_recipe, *overrides) -> dict[str, str]:
    with pytest.raises(ConfigError) as caught:
        load_config(write_recipe(base_toml), list(overrides))
    return {p.path: str(p) for p in caught.value.problems}


def test_off_by_default_and_loads_with_local_engine_ray_workers_and_ranks(base_toml,
                                                                           write_recipe):
    """Off by default (staleness 1 once on); on, it loads with the local engine, with Ray
    rollout workers and with learner ranks, at staleness 1 and 0."""
    assert not load_config(write_recipe(base_toml)).train.async_rollouts
    for extra in ([], ["--dist.rollout_workers=2"], ["--dist.learner_ranks=2",
                                                      "--rollout.batch_size=16",
                                                      "--train.micro_batch_size=4"],
                  ["--train.async_staleness=0"]):
        config = load_config(write_recipe(base_toml), ["--train.async_rollouts=true", *extra])
        assert config.train.async_rollouts
        assert config.train.async_staleness == (0 if extra == ["--train.async_staleness=0"]
                                                else 1)


def test_staleness_without_async_rollouts_is_refused(base_toml, write_recipe):
    """async_staleness other than its default, without async_rollouts: refused, naming the
    key that turns it on."""
    found = _problems(base_toml, write_recipe, "--train.async_staleness=0")
    assert list(found) == ["train.async_staleness"]
    assert "without train.async_rollouts = true" in found["train.async_staleness"]


def test_staleness_above_one_is_refused(base_toml, write_recipe):
    """Only one step off policy is built: a staleness of 2 is out of range."""
    found = _problems(base_toml, write_recipe, "--train.async_rollouts=true",
                      "--train.async_staleness=2")
    assert "less than or equal to 1" in found["train.async_staleness"]


def test_vllm_in_this_process_is_refused_with_the_ray_alternative(base_toml, write_recipe,
                                                                  monkeypatch):
    """vLLM in this process (its generate moves the global torch RNG the learner's thread
    uses): refused, naming Ray rollout workers; vLLM in Ray workers is not refused for it.
    The vllm package is made to look installed, so the refusal is this check's alone."""
    from qarl.rollout.engines import ENGINES

    monkeypatch.setattr(type(ENGINES["vllm"]), "installed", lambda self: True)
    common = ["--train.async_rollouts=true", "--rollout.engine=vllm", "--quant.align=fake"]
    found = _problems(base_toml, write_recipe, *common)
    assert "train.async_rollouts" in found
    assert "dist.rollout_workers > 1" in found["train.async_rollouts"]
    try:
        load_config(write_recipe(base_toml), [*common, "--dist.rollout_workers=2"])
    except ConfigError as err:
        assert all(p.path != "train.async_rollouts" for p in err.problems), err


def test_every_problem_at_once(base_toml, write_recipe):
    """The staleness refusal and an unrelated bad key are reported together."""
    found = _problems(base_toml, write_recipe, "--train.async_staleness=0",
                      "--rollout.batch_size=30")
    assert "train.async_staleness" in found and "rollout.batch_size" in found
