"""`qarl compare tbpo_quick` end to end (the quick version of the TBPO comparison): the arms
where TBPO can act run, and the report carries their clips, band drops and error tokens."""

from __future__ import annotations

import json

import pytest

from qarl.cli import main
from qarl.config.arms import load_arms

ARMS = "fake-grpo,fake-tbpo,kernel-tbpo"


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    assert main(["compare", "tbpo_quick", "--arms", ARMS, "--train.steps=3", "--jobs", "2",
                 f"--run.output_dir={out}"]) == 0
    folder = out / "tbpo_quick"
    table = json.loads((folder / "compare.json").read_text())
    return {**table, "folder": folder}, (folder / "report.md").read_text()


def test_every_arm_of_the_recipe_is_valid():
    """All eight arms of the comparison load (the test runs three of them)."""
    plan = load_arms("tbpo_quick")
    assert list(plan.configs) == ["fp-grpo", "fake-grpo", "fake-grpo-tis", "fake-gspo",
                                  "fake-tbpo", "naive-grpo", "naive-tbpo", "kernel-tbpo"]
    assert all(c.train.mini_batches == 2 for c in plan.configs.values())


@pytest.mark.parametrize("recipe", ["tbpo", "tbpo_quick"])
def test_unaligned_arms_take_logp_by_the_forward(recipe):
    """The naive and fake arms take logp values from the learner's forward (the value verl and
    TRL use, and the faster pass); the exact arms (kernel, full precision) keep the audited
    decode-path replay, the only one the config accepts for them."""
    plan = load_arms(recipe)
    paths = {arm: c.train.logp_path for arm, c in plan.configs.items()}
    exact = {"fp-grpo", "kernel-tbpo"}
    assert {arm for arm, path in paths.items() if path == "decode"} == exact
    assert all(paths[arm] == "forward" for arm in set(paths) - exact)


def test_tbpo_acts_where_it_can(report):
    """Under `fake` alignment the learner's old_logp differs from the sampler's (rho != 1);
    under `kernel` it is exactly the sampler's (rho = 1, no band drop possible). With two
    mini-batches the second optimizer step is off-policy, so every arm's clips act; the
    report has the clips and trust band table."""
    table, text = report
    arms = table["arms"]
    assert arms["kernel-tbpo"]["figures"]["abs_diff_max"]["mean"] == 0.0
    assert arms["kernel-tbpo"]["figures"]["band_drop"]["mean"] == 0.0
    for arm in ("fake-grpo", "fake-tbpo"):
        assert arms[arm]["figures"]["abs_diff_mean"]["mean"] > 0.0
    for arm in ARMS.split(","):
        assert arms[arm]["figures"]["clip_frac"]["mean"] > 0.0, arm
        assert arms[arm]["figures"]["truncated"]["mean"] is not None
    assert "## Clips and trust band" in text and "band drops" in text


def test_the_budgets_flag_no_step_of_a_healthy_run(report, tmp_path_factory):
    """Every step of every arm is within its run's mismatch budget: 0 on the decode path where
    it is exact (kernel: mismatch 0), budget_factor x the first step's elsewhere (the fake arms
    take their values from the forward): contract/over_budget = 0 at every step."""
    table, _ = report
    for arm in ARMS.split(","):
        rows = [json.loads(line) for line in (table["folder"] / arm / "seed0" / "metrics.jsonl")
                .read_text().splitlines()]
        train = [r for r in rows if r.get("kind") == "train"]
        assert len(train) == 3, arm
        assert [r["contract/over_budget"] for r in train] == [0.0, 0.0, 0.0], arm
        assert all(r["contract/budget"] >= 0 for r in train), arm


def test_each_run_keeps_its_final_weights_without_optimizer_state(report):
    """The comparison's recipe saves the runs' final checkpoints weights-only
    (train.final_checkpoint = 'weights'): the master weights to evaluate or export, no AdamW
    moments (two thirds of a full checkpoint)."""
    table, _ = report
    for arm in ARMS.split(","):
        run = table["folder"] / arm / "seed0"
        final = run / (run / "latest").read_text().strip()
        assert final.name == "step_000003", arm
        assert (final / "model.safetensors").is_file(), arm
        assert not (final / "optimizer.safetensors").exists(), arm
        assert json.loads((final / "state.json").read_text())["optimizer_state"] is False
