"""`qarl compare claim_quick` then `qarl report` end to end (the quick version of the comparison
where the paper's claim can be tested, recipes/claim.toml): every arm runs, the held-out seed
is reported apart from the development seed, and the clips act in every arm. The end-to-end
tests are slow (make test-slow); the recipes' agreement is not."""

from __future__ import annotations

import json

import pytest

from qarl.cli import main
from qarl.config import load_config
from qarl.config.arms import load_arms

ARMS = ["fp-grpo", "naive-grpo", "naive-grpo-tis", "kernel-grpo", "kernel-tbpo", "fake-grpo",
        "fake-tbpo"]


def mechanics(config) -> tuple:
    """What makes an arm the arm it is, whatever the model, task and budget."""
    return (config.quant.scheme == "none", config.quant.align, config.algo.loss,
            config.algo.correction, config.train.logp_path, config.train.mini_batches)


def test_the_quick_recipe_runs_the_full_recipes_arms():
    """claim_quick has claim's seven arms with the same mechanics (alignment, loss,
    correction, logp path, two optimizer steps per rollout batch) and the same format; claim
    develops on seeds 0, 1, 2 and holds seed 3 out."""
    full, quick = load_arms("claim"), load_arms("claim_quick")
    assert list(full.configs) == list(quick.configs) == ARMS
    for arm in ARMS:
        assert mechanics(full.configs[arm]) == mechanics(quick.configs[arm]), arm
        assert full.configs[arm].quant.options == quick.configs[arm].quant.options, arm
    assert {arm for arm, c in full.configs.items() if c.quant.scheme == "none"} == {"fp-grpo"}
    assert all(c.train.mini_batches == 2 for c in full.configs.values())
    compare = load_config("claim").compare
    assert (compare.seeds, compare.held_out_seeds) == ([0, 1, 2], [3])
    assert (compare.reference, compare.baseline) == ("fp-grpo", "naive-grpo")
    assert full.seeds == [0, 1, 2, 3]


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """compare.json after `qarl compare claim_quick` (every arm, seed 0 and held-out seed 1),
    and the report.md that `qarl report` then rewrites from the run folders."""
    out = tmp_path_factory.mktemp("runs")
    assert main(["compare", "claim_quick", "--jobs", "2", f"--run.output_dir={out}"]) == 0
    folder = out / "claim_quick"
    written = json.loads((folder / "compare.json").read_text())
    (folder / "report.md").unlink()
    assert main(["report", str(folder)]) == 0
    return folder, written


@pytest.mark.slow  # the fixture runs 14 `qarl train` processes
def test_report_rewrites_what_compare_wrote(compared):
    """`qarl report` on the folder gives the compare.json that `qarl compare` wrote (timings
    and all: both read the same metrics files)."""
    folder, written = compared
    assert json.loads((folder / "compare.json").read_text()) == written


@pytest.mark.slow  # the fixture runs 14 `qarl train` processes
def test_the_held_out_seed_is_reported_apart(compared):
    """Every arm's main figures come from seed 0 alone and its held-out figures from seed 1
    alone; report.md has the held-out table after the four main ones."""
    folder, table = compared
    assert list(table["arms"]) == list(table["held_out"]) == ARMS
    for arm in ARMS:
        assert table["arms"][arm]["seeds"] == [0], arm
        assert table["held_out"][arm]["seeds"] == [1], arm
        assert len(table["held_out"][arm]["figures"]["accuracy_deployed"]["values"]) == 1, arm
    text = (folder / "report.md").read_text()
    assert text.index("## Seconds per training step") < text.index("## Held-out seeds")
    assert "Seeds 1 (compare.held_out_seeds)" in text


@pytest.mark.slow  # the fixture runs 14 `qarl train` processes
def test_mismatch_and_clips_act_where_the_arms_say(compared):
    """`kernel` arms: the learner's old_logp is the sampler's (max |dlogp| 0); `naive` and
    `fake`: it is not. Two optimizer steps per rollout batch: the second is off-policy, so
    every arm clips some tokens."""
    _, table = compared
    for part in ("arms", "held_out"):
        figures = {arm: entry["figures"] for arm, entry in table[part].items()}
        for arm in ("kernel-grpo", "kernel-tbpo"):
            assert figures[arm]["abs_diff_max"]["mean"] == 0.0, (part, arm)
        for arm in ("naive-grpo", "naive-grpo-tis", "fake-grpo", "fake-tbpo"):
            assert figures[arm]["abs_diff_mean"]["mean"] > 0.0, (part, arm)
        for arm in ARMS:
            assert figures[arm]["clip_frac"]["mean"] > 0.0, (part, arm)
