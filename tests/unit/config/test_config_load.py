"""Loading recipes: overrides, defaults, derived fields, the resolved-config round trip."""

from __future__ import annotations

import math
import typing
from pathlib import Path

import pytest

from qarl.config import (
    RECIPES_DIR,
    SECTIONS,
    ConfigError,
    RunConfig,
    load_arms,
    load_config,
    packaged_recipes,
    parse_overrides,
    save_resolved,
    to_toml,
)
from qarl.config.load import UNSET, parse_value

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("text, expected", [
    ("1e-5", 1e-5), ("3", 3), ("true", True), ("w4a16-int4", "w4a16-int4"),
    ('["q_proj", "k_proj"]', ["q_proj", "k_proj"]), ("{l_max = 16, l_cache = 4}",
                                                    {"l_max": 16, "l_cache": 4}),
    ('"42"', "42"), ("a b", "a b"), ("./data/x.jsonl", "./data/x.jsonl"),
])
def test_parse_value(text, expected):
    """Values are TOML literals when they parse as one, else the bare string."""
    value = parse_value(text)
    assert value == expected and type(value) is type(expected)


def test_parse_overrides_forms():
    """--k=v, --k v, k=v and --k= (unset) all parse; later keys win."""
    overrides = parse_overrides(["--train.lr=1e-5", "--rollout.top_k", "4", "train.steps=3",
                                 "--algo.loss_params.eps_high=5e-4", "--task.name="])
    assert overrides == {"train.lr": 1e-5, "rollout.top_k": 4, "train.steps": 3,
                         "algo.loss_params.eps_high": 5e-4, "task.name": UNSET}


@pytest.mark.parametrize("items, fragment", [
    (["--train.steps"], "override has no value"),
    (["--train..steps=3"], "no valid section.key name"),
    (["--=3"], "no valid section.key name"),
])
def test_parse_overrides_errors(items, fragment):
    """A malformed override is a ConfigError that shows the fix."""
    with pytest.raises(ConfigError, match=fragment):
        parse_overrides(items)


def test_overrides_apply_at_any_depth(base_toml, write_recipe):
    """String and dict overrides set nested values; the dict form takes values as they are."""
    path = write_recipe(base_toml)
    config = load_config(path, ["--algo.loss_params.eps_high=5e-4", "--quant.include=[\"q_proj\"]",
                                "--quant.scheme=w4a16-int4", "--train.lr", "2e-5"])
    assert config.algo.loss_params == {"eps_high": 5e-4}
    assert config.quant.include == ["q_proj"] and config.quant.scheme == "w4a16-int4"
    assert config.train.lr == 2e-5
    same = load_config(path, {"algo.loss_params.eps_high": 5e-4, "quant.include": ["q_proj"],
                              "quant.scheme": "w4a16-int4", "train.lr": 2e-5})
    assert same == config


def test_unset_restores_the_default(base_toml, write_recipe):
    """--key= and a None dict value remove a recipe's key so the default applies."""
    path = write_recipe(base_toml + '[algo]\ncorrection = "tis_token"\n')
    assert load_config(path).algo.correction == "tis_token"
    assert load_config(path, ["--algo.correction="]).algo.correction is None
    assert load_config(path, {"algo.correction": None}).algo.correction is None


def test_derived_fields_are_resolved(base_toml, write_recipe):
    """run.name comes from the file stem; eval size / temperature / length from task and
    rollout unless set; a dataset path is made absolute."""
    config = load_config(write_recipe(base_toml, name="my-run"),
                         ["--rollout.temperature=0.7", "--rollout.max_new_tokens=12"])
    assert config.run.name == "my-run"
    assert (config.eval.size, config.eval.temperature, config.eval.max_new_tokens) == (200, 0.7, 12)
    config = load_config(write_recipe(base_toml), ["--eval.size=5", "--eval.max_new_tokens=3"])
    assert (config.eval.size, config.eval.max_new_tokens) == (5, 3)


def test_dataset_path_is_resolved(base_toml, write_recipe, tmp_path, monkeypatch):
    """A relative dataset path is checked against the current folder and saved absolute."""
    rows = "".join(f'{{"prompt": "{a}+1", "answer": "{a + 1}"}}\n' for a in range(100))
    (tmp_path / "rows.jsonl").write_text(rows)  # enough rows for both splits
    monkeypatch.chdir(tmp_path)
    config = load_config(write_recipe(base_toml), ["--task.name=", "--task.dataset=rows.jsonl"])
    assert config.task.dataset == str(tmp_path / "rows.jsonl")


def test_default_is_packaged_default():
    """load_config(None) is recipes/default.toml, which is the packaged qarl/recipes copy."""
    assert load_config(None) == load_config(str(REPO / "recipes" / "default.toml"))
    assert load_config(None) == load_config("default")
    assert load_config(None).run.name == "default"


def test_repo_recipes_are_the_packaged_ones():
    """recipes/*.toml and qarl/recipes/*.toml (shipped in the wheel) hold the same files."""
    repo = sorted((REPO / "recipes").glob("*.toml"))
    assert [p.name for p in repo] == [f"{name}.toml" for name in packaged_recipes()]
    for path in repo:
        assert path.read_bytes() == (RECIPES_DIR / path.name).read_bytes()


@pytest.mark.parametrize("name", ["default", "tiny", "compare"])
def test_packaged_recipes_load(name):
    """Every packaged recipe loads without a problem."""
    assert load_config(name).run.name == name


def test_compare_arms_load():
    """compare.toml's five arms load and differ as their comments state; the sixth (fake
    alignment) is optional, so it runs only when named."""
    plan = load_arms("compare")
    configs = list(plan.configs.values())
    assert list(plan.configs) == ["fp-grpo", "naive-grpo", "naive-grpo-tis", "qarl-grpo",
                                  "qarl-tbpo"]
    assert configs[0].quant.scheme == "none"
    assert [c.quant.align for c in configs[1:]] == ["naive", "naive", "kernel", "kernel"]
    assert configs[2].algo.correction == "tis_token"
    assert [c.algo.loss for c in configs] == ["grpo"] * 4 + ["tbpo"]
    fake = load_arms("compare", arms=["qarl-fake-tbpo"]).configs["qarl-fake-tbpo"]
    assert (fake.quant.align, fake.algo.loss) == ("fake", "tbpo")


def test_run_config_is_rechecked():
    """A RunConfig passed back in is validated again (cross-field checks included)."""
    config = load_config(None)
    assert load_config(config) == config
    with pytest.raises(ConfigError, match="rollout.batch_size: 30"):
        load_config(config, {"rollout.batch_size": 30})


def test_optional_fields_default_to_none():
    """Every optional field defaults to None: omitting it in a saved config means the same."""
    for section, model in SECTIONS.items():
        for key, field in model.model_fields.items():
            if type(None) in typing.get_args(field.annotation):
                assert field.default is None, f"{section}.{key}"


def test_every_field_is_described():
    """Each option has a description (docs/config.md is generated from them)."""
    for section, model in SECTIONS.items():
        assert model.__doc__, section
        for key, field in model.model_fields.items():
            assert field.description, f"{section}.{key}"


TRICKY = ['quote " and \\ backslash', "tab\tnew\nline", "unicode: π ≈ 3.14 ✓", "del \x7f",
          "", "emoji 😀"]


@pytest.mark.parametrize("text", TRICKY)
def test_resolved_round_trip_strings(text, tmp_path):
    """Strings with escapes, control characters and non-ASCII survive save -> load exactly."""
    config = load_config(None, {"task.system_prompt": text, "quant.include": [text, "x"]})
    path = save_resolved(config, tmp_path / "run")
    assert path == tmp_path / "run" / "config.toml"
    assert load_config(path) == config


def test_resolved_round_trip_everything(tmp_path):
    """A config with every kind of value (floats of any size, nested tables, optional tables,
    unions) is equal after save_resolved -> load_config, and writing it again is identical."""
    overrides = {
        "train.lr": 1.2345678901234567e-7, "train.min_lr": 1e-300, "train.betas": [0.0, 0.95],
        "algo.overlong": {"l_max": 16, "l_cache": 4}, "algo.correction": "mis_seq",
        "algo.correction_params": {"low": 0.25, "high": 4}, "log.tensorboard": False,
        "algo.loss_params": {"eps_high": 5e-4, "is_cap": 2}, "task.reward": "qarl.tasks.addition:addition_reward",
        "quant.scheme": "w4a16-int4", "quant.options": {"group_size": 64},
        "rollout.top_p": 0.95, "run.seed": 2**40, "eval.temperature": 0.3,
    }
    config = load_config(None, overrides)
    path = save_resolved(config, tmp_path)
    again = load_config(path)
    assert again == config
    assert math.copysign(1, again.train.betas[0]) == 1.0
    assert to_toml(again) == to_toml(config)


def test_resolved_config_keeps_its_name(tmp_path):
    """The saved config.toml carries run.name, so reloading it does not rename the run."""
    config = load_config("tiny")
    assert load_config(save_resolved(config, tmp_path)).run.name == "tiny"


def test_model_path_is_resolved(tmp_path, monkeypatch, tiny_dir):
    """A local model path (not a zoo name) is accepted when it holds a model, and saved
    absolute."""
    import shutil

    shutil.copytree(tiny_dir, tmp_path / "m")
    monkeypatch.chdir(tmp_path)
    assert load_config(None, {"model.name": "m"}).model.name == str(tmp_path / "m")


def test_loaded_config_is_frozen():
    """A loaded config cannot be changed by accident (the trainer reads, never writes)."""
    config = load_config(None)
    with pytest.raises(Exception):
        config.train.steps = 3
    assert isinstance(config, RunConfig)
