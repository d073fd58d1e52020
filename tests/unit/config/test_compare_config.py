"""The [compare] section: arms as override sets, checked before any run, ignored by training."""

from __future__ import annotations

from pathlib import Path

import pytest

from qarl.config import ConfigError, load_arms, load_config, recipe_path, save_resolved
from qarl.config.compare_schema import flatten_overrides
from qarl.config.toml_out import _key, toml_value
from qarl.tasks import make_task
from qarl.train.phases import train_examples

ARMS = {"a": {"quant": {"align": "naive"}}, "b": {"quant": {"align": "kernel"}}}


def tiny_with(folder: Path, compare: dict) -> Path:
    """A copy of the tiny recipe in `folder` with its [compare] section replaced."""
    text = recipe_path("tiny").read_text().split("\n[compare]")[0]
    text += "\n[compare]\n" + "".join(f"{_key(k)} = {toml_value(v)}\n" for k, v in compare.items())
    path = folder / "recipe.toml"
    path.write_text(text)
    return path


def problems_of(recipe, overrides=(), arms=None) -> list[str]:
    with pytest.raises(ConfigError) as error:
        load_arms(recipe, overrides, arms)
    return [str(problem) for problem in error.value.problems]


def test_compare_toml_base_values():
    """compare.toml holds the base setting of the comparison the README reports."""
    base = load_config("compare")
    assert base.run.seed == 0 and base.model.name == "smollm2-135m"
    assert (base.quant.scheme, base.quant.align) == ("w4a16-int4", "kernel")
    r = base.rollout
    assert (r.group_size, r.batch_size, r.max_new_tokens, r.temperature) == (8, 32, 16, 1.0)
    t = base.task
    assert (t.name, t.options, t.eval_size) == ("addition", {"digits": 1}, 100)
    assert (base.algo.loss, base.algo.advantage) == ("grpo", "grpo")
    tr = base.train
    assert (tr.steps, tr.micro_batch_size, tr.lr) == (12, 16, 1e-5)
    e = base.eval
    assert (e.every, e.greedy, e.temperature, e.full_precision) == (4, False, 1.0, True)
    assert base.log.progress is False
    c = base.compare
    assert (c.seeds, c.reference, c.baseline) == ([0, 1, 2], "fp-grpo", "naive-grpo")
    assert list(c.arms) == ["fp-grpo", "naive-grpo", "naive-grpo-tis", "qarl-grpo",
                            "qarl-tbpo", "qarl-fake-tbpo"]
    assert c.optional == ["qarl-fake-tbpo"]
    assert c.overrides_of("naive-grpo-tis") == {"quant.align": "naive",
                                                "algo.correction": "tis_token"}


def test_flatten_stops_at_section_key():
    """Dotted TOML keys flatten to section.key; a table below that (task.options) stays one
    value, so it replaces the recipe's like --task.options={...} on the command line."""
    assert flatten_overrides({"quant": {"scheme": "none"}, "task": {"options": {"digits": 2}},
                              "algo.loss": "tbpo"}) == {
        "quant.scheme": "none", "task.options": {"digits": 2}, "algo.loss": "tbpo"}


def test_train_ignores_compare_and_keeps_it_in_config_toml(tmp_path):
    """A recipe with [compare] trains as without it, and its resolved config.toml (where the
    report finds the arms) loads back equal; a recipe without [compare] writes none."""
    config = load_config("compare")
    assert load_config(save_resolved(config, tmp_path / "a")) == config
    plain = load_config("compare", {"compare": None})
    assert plain.compare is None and plain.model_copy(update={"compare": config.compare}) == config
    assert "[compare]" not in save_resolved(plain, tmp_path / "b").read_text()


def test_arm_order_optional_and_command_line(tmp_path):
    """Arms run in recipe order without the optional ones; --arms picks and orders them;
    shared overrides go first, the arm's next, the command line's last."""
    data = tiny_with(tmp_path, {"arms": {**ARMS, "c": {"algo": {"loss": "grpo"}}},
                                "optional": ["c"],
                                "overrides": {"train": {"steps": 3}, "quant": {"align": "fake"}}})
    plan = load_arms(data)
    assert list(plan.configs) == ["a", "b"]
    assert [c.quant.align for c in plan.configs.values()] == ["naive", "kernel"]
    assert plan.configs["a"].train.steps == 3
    plan = load_arms(data, ["--train.steps=2", "--quant.align=naive"], arms=["c", "b"])
    assert list(plan.configs) == ["c", "b"]
    assert [c.quant.align for c in plan.configs.values()] == ["naive", "naive"]
    assert plan.configs["c"].train.steps == 2 and plan.configs["c"].algo.loss == "grpo"
    assert plan.overrides == {"train.steps": 2, "quant.align": "naive"}
    assert plan.arm_overrides["c"] == {"train.steps": 3, "quant.align": "fake", "algo.loss": "grpo"}


def test_every_bad_arm_is_reported_at_once_with_its_name(tmp_path):
    """Each arm is checked as the recipe it gives; every problem of every arm (chosen or not)
    comes in one error that names the arm and the offending key."""
    arms = {"ok": {}, "bad": {"quant": {"scheme": "w9"}, "algo": {"los": 1}},
            "worse": {"rollout": {"batch_size": 30}}}
    data = tiny_with(tmp_path, {"arms": arms, "optional": ["worse"]})
    problems = problems_of(data, arms=["ok", "worst"])
    assert problems[0] == "--arms: 'worst' is not an arm of the recipe; did you mean 'worse'?"
    assert any(p.startswith("compare.arms.bad: gives algo.los: unknown key 'los'")
               for p in problems)
    assert any(p.startswith("compare.arms.bad: gives quant.scheme: unknown") for p in problems)
    assert any(p.startswith("compare.arms.worse: gives rollout.batch_size: 30 is not a "
                            "multiple") for p in problems)
    assert not any("compare.arms.ok" in p for p in problems)


@pytest.mark.parametrize("compare, expected", [
    ({"arms": ARMS, "reference": "fp"},
     "compare.reference: 'fp' is not an arm; valid names: a, b"),
    ({"arms": ARMS, "optional": ["c"]},
     "compare.optional[0]: 'c' is not an arm; valid names: a, b"),
    ({"arms": {"a/b": {}}}, "compare.arms.a/b: is not a plain folder name"),
    ({"arms": ARMS, "seeds": [0, 1, 0]}, "compare.seeds: repeats [0]; list each seed once"),
    ({"arms": ARMS, "seeds": [-1]}, "compare.seeds: [-1] holds a negative seed"),
    ({"arms": {"a": {"run": {"seed": 3}}}}, "compare.arms.a: sets 'run.seed'; compare sets"),
    ({"arms": ARMS, "overrides": {"run.name": "x"}}, "compare.overrides: sets 'run.name'"),
    ({"arms": {}}, "compare.arms: Dictionary should have at least 1 item"),
    ({"arm": ARMS}, "compare.arm: unknown key 'arm'; did you mean 'arms'?"),
    ({"arms": ARMS, "seeds": []}, "compare.seeds: List should have at least 1 item"),
    ({"arms": ARMS, "held_out_seeds": [3, 3]},
     "compare.held_out_seeds: repeats [3]; list each seed once"),
    ({"arms": ARMS, "held_out_seeds": [-3]}, "compare.held_out_seeds: [-3] holds a negative"),
    ({"arms": ARMS, "seeds": [0, 1], "held_out_seeds": [1, 2]},
     "compare.held_out_seeds: [1] also in compare.seeds; a held-out seed is kept out"),
])
def test_bad_compare_sections(compare, expected, tmp_path):
    """A malformed [compare] section is refused with the path and what to do."""
    problems = problems_of(tiny_with(tmp_path, compare))
    assert any(p.startswith(expected) for p in problems), problems


def test_held_out_seeds_run_after_the_development_seeds(tmp_path):
    """compare.held_out_seeds run with compare.seeds (after them) whatever --seeds names, and
    an empty list on the command line leaves them out."""
    data = tiny_with(tmp_path, {"arms": ARMS, "seeds": [0, 1], "held_out_seeds": [5]})
    assert load_arms(data).seeds == [0, 1, 5]
    assert load_arms(data, {"compare.seeds": [2]}).seeds == [2, 5]
    assert load_arms(data, ["--compare.held_out_seeds=[]"]).seeds == [0, 1]
    assert load_config(data).compare.held_out_seeds == [5]


def test_recipe_without_compare_seed_override_and_repeated_arm():
    """compare needs a [compare] section, takes its seeds from it (or --seeds), never from
    --run.seed, and runs each arm once."""
    assert problems_of("default")[0].startswith("compare: the recipe has no [compare] section")
    assert problems_of("tiny", ["--run.seed=3"]) == [
        "run.seed: is set by compare for each run from compare.seeds; give the seeds with --seeds"]
    assert problems_of("tiny", arms=["fp", "qarl", "fp"]) == [
        "--arms: fp,qarl,fp names an arm twice; name each once"]


def test_no_arm_and_a_train_run_folder_are_refused(tmp_path):
    """An empty list of arms is refused (not read as "every arm"), and so is a comparison
    folder that is a `qarl train` run folder (it holds config.toml), where the arms' runs
    would be written among the run's own files."""
    assert problems_of("tiny", arms=[]) == [
        "--arms: names no arm; name one or more of fp, naive, qarl, or leave --arms out"]
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.toml").write_text("[run]\n")
    assert problems_of("tiny", [f"--run.output_dir={tmp_path}"]) == [
        f"run.name: {tmp_path / 'tiny'} is the run folder of a `qarl train` run (it holds "
        "config.toml), not a comparison folder; give the comparison its own --run.name or "
        "--run.output_dir"]


@pytest.mark.parametrize("recipe", ["compare", "tiny", "claim", "claim_quick"])
def test_first_step_prompts_equal_across_arms(recipe):
    """Every arm (optional ones too) sees the same prompts at a step: they follow from
    (run.seed, step) and the task, which no shipped arm changes."""
    plan = load_arms(recipe)
    every = load_arms(recipe, arms=list(plan.configs) + list(load_config(recipe).compare.optional))
    prompts = []
    for config in every.configs.values():
        task = make_task(config.task.name, **config.task.options)
        prompts.append([(e.prompt, e.answer) for e in train_examples(
            task, 0, 0, config.rollout.batch_size // config.rollout.group_size)])
    assert all(p == prompts[0] for p in prompts[1:])
    assert len(prompts) == len(every.configs) >= 3
