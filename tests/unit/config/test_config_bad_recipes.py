"""Table-driven: each bad recipe is rejected with a message naming the field and the fix."""

from __future__ import annotations

import pytest
from qarl.config import ConfigError, load_config

# (id, recipe: a list of overrides applied to the base recipe (conftest.BASE_TOML), or a
#  TOML text where {base} stands for the base recipe,
#  fragments the single problem's line must contain)
BAD_RECIPES = [
    ("typo-key", ["--rollout.max_new_token=8"],
     ["rollout.max_new_token: unknown key 'max_new_token'", "did you mean 'max_new_tokens'?"]),
    ("typo-section", "[rolout]\ngroup_size = 4\n{base}",
     ["rolout: unknown section 'rolout'", "did you mean 'rollout'?"]),
    ("unknown-nested-key", ["--algo.overlong={l_max = 16, l_cache = 4, ramp = 2}"],
     ["algo.overlong.ramp: unknown key 'ramp'", "valid names: l_cache, l_max"]),
    ("typo-loss-param", ["--algo.loss_params.eps_hihg=1e-3"],
     ["algo.loss_params.eps_hihg: unknown parameter", "did you mean 'eps_high'?"]),
    ("typo-correction-param", ["--algo.correction=tis_token", "--algo.correction_params.cpa=3"],
     ["algo.correction_params.cpa: unknown parameter 'cpa'", "did you mean 'cap'?"]),
    ("typo-task-option", ["--task.options={digts = 2}"],
     ["task.options.digts: unknown parameter 'digts'", "did you mean 'digits'?"]),
    ("typo-scheme-option", ["--quant.scheme=w4a16-int4", "--quant.options={group_sise = 64}"],
     ["quant.options.group_sise: unknown parameter", "did you mean 'group_size'?"]),
    ("string-for-int", ["--train.steps=\"ten\""],
     ["train.steps: should be a valid integer", "(got 'ten')"]),
    ("bool-for-int", ["--rollout.group_size=true"],
     ["rollout.group_size: should be a valid integer", "(got True)"]),
    ("quoted-number", '{base}[rollout]\nbatch_size = "32"\n',
     ["rollout.batch_size: should be a valid integer", "(got '32')"]),
    ("string-for-list", ["--quant.include=q_proj"],
     ["quant.include: should be a valid list", "(got 'q_proj')"]),
    ("section-not-table", "rollout = 5\n{base}",
     ["rollout: should be a table [rollout], got 5"]),
    ("override-into-scalar", ["--train.lr.x=1"],
     ["train.lr: is 0.0001, not a table", "'train.lr.x'"]),
    ("batch-not-whole-groups", ["--rollout.group_size=5", "--rollout.batch_size=24"],
     ["rollout.batch_size: 24 is not a multiple of rollout.group_size (5)", "use e.g. 20 or 25"]),
    ("batch-not-whole-micro-batches", ["--train.micro_batch_size=12"],
     ["train.micro_batch_size: rollout.batch_size (32) is not a multiple of 12"]),
    ("name-and-dataset", ["--task.dataset=data.jsonl"],
     ["task: both name ('addition') and dataset", "--task.name="]),
    ("no-task", ["--task.name="], ["task: set task.name", "or task.dataset"]),
    ("dataset-missing", ["--task.name=", "--task.dataset=nope.jsonl"],
     ["task.dataset: file", "nope.jsonl' does not exist"]),
    ("unknown-task", ["--task.name=additon"],
     ["task.name: unknown task 'additon'", "did you mean 'addition'?"]),
    ("bad-reward", ["--task.reward=mymodule.score"],
     ["task.reward: 'mymodule.score' is neither a built-in reward", "'module:function'"]),
    ("batch-with-builtin-reward", ["--task.reward_batch=true"],
     ["task.reward_batch: true with the task's own verifier", "'module:function'",
      "task.reward_batch = false"]),
    ("align-value", ["--quant.align=full"],
     ["quant.align: should be 'naive', 'fake' or 'kernel'", "(got 'full')"]),
    ("align-renamed", ["--quant.align=none"],
     ["quant.align:", "now called 'naive'", "align = \"naive\""]),
    ("unknown-scheme", ["--quant.scheme=w8a8-in8"],
     ["quant.scheme: unknown scheme 'w8a8-in8'", "did you mean 'w8a8-int8'?"]),
    ("options-without-scheme", ["--quant.scheme=none", "--quant.options={group_size = 64}"],
     ["quant.options: set while quant.scheme is 'none'"]),
    ("unknown-loss", ["--algo.loss=tbp"],
     ["algo.loss: unknown loss 'tbp'", "did you mean 'tbpo'?"]),
    ("loss-param-value", ["--algo.loss_params.eps_low=1.5"],
     ["algo.loss_params: invalid parameters for loss 'tbpo'", "eps_low must be in [0, 1)"]),
    ("unknown-correction", ["--algo.correction=tis_tokn"],
     ["algo.correction: unknown correction 'tis_tokn'", "did you mean 'tis_token'?"]),
    ("correction-params-alone", ["--algo.correction_params={cap = 2.0}"],
     ["algo.correction_params: set but algo.correction is not"]),
    ("unknown-aggregation", ["--algo.aggregation=token-maen"],
     ["algo.aggregation: unknown aggregation 'token-maen'", "did you mean 'token-mean'?"]),
    ("aggregation-twice", ["--algo.aggregation=token-mean",
                           "--algo.loss_params.aggregation=token-mean"],
     ["algo.aggregation: also set in algo.loss_params; keep one"]),
    ("advantage-value", ["--algo.advantage=ppo"],
     ["algo.advantage: should be 'grpo', 'dr_grpo', 'rloo', 'reinforce_pp' or "
      "'reinforce_pp_baseline'", "(got 'ppo')"]),
    ("overlong-ramp", ["--algo.overlong={l_max = 8, l_cache = 8}"],
     ["algo.overlong.l_cache: 8 must be below l_max (8)"]),
    ("overlong-too-long", ["--algo.overlong={l_max = 64, l_cache = 8}"],
     ["algo.overlong.l_max: 64 exceeds rollout.max_new_tokens (32)"]),
    ("overlong-missing", ["--algo.overlong={l_max = 16}"],
     ["algo.overlong.l_cache: required but missing"]),
    ("lr-negative", ["--train.lr=-1e-5"], ["train.lr: should be greater than or equal to 0", "(got -1e-05)"]),
    ("min-lr-above-lr", ["--train.min_lr=1e-3"],
     ["train.min_lr: 0.001 is above train.lr (0.0001)"]),
    ("warmup-longer-than-run", ["--train.warmup_steps=5"],
     ["train.warmup_steps: 5 is more than train.steps (2)", "use at most 2"]),
    ("beta-one", ["--train.betas=[0.9, 1.0]"], ["train.betas: each beta must be in [0, 1)"]),
    ("betas-length", ["--train.betas=[0.9]"], ["train.betas: List should have at least 2 items"]),
    ("optimizer-value", ["--train.optimizer=sgd"],
     ["train.optimizer: should be 'adamw' or 'muon'", "(got 'sgd')"]),
    ("group-of-one", ["--rollout.group_size=1", "--rollout.batch_size=8"],
     ["rollout.group_size: should be greater than or equal to 2", "(got 1)"]),
    ("temperature-zero", ["--rollout.temperature=0"],
     ["rollout.temperature: should be greater than 0"]),
    ("top-p-above-one", ["--rollout.top_p=1.5"],
     ["rollout.top_p: should be less than or equal to 1", "(got 1.5)"]),
    ("dtype-value", ["--model.master_dtype=float16"],
     ["model.master_dtype: should be 'float32' or 'bfloat16'", "(got 'float16')"]),
    ("bf16-masters-trained", ["--model.master_dtype=bfloat16"],
     ["model.master_dtype: 'bfloat16' master weights round small optimizer updates away",
      "set train.compute_dtype = 'bfloat16'", "train.lr = 0"]),
    ("compute-dtype-value", ["--train.compute_dtype=float16"],
     ["train.compute_dtype: should be 'auto', 'float32' or 'bfloat16'", "(got 'float16')"]),
    ("codes-backward-fp8", ["--train.quant_backward=codes", "--quant.scheme=w8a8-fp8"],
     ["train.quant_backward: 'codes' with quant.scheme = 'w8a8-fp8'",
      "['w4a16-int4', 'w4a16-nvfp4', 'w8a8-int8']", "Use 'float' or 'auto'"]),
    ("codes-backward-naive", ["--train.quant_backward=codes", "--quant.align=naive"],
     ["train.quant_backward: 'codes' with quant.align = 'naive'", "quant.align = 'kernel'"]),
    ("model-missing", ["--model.name=./nope/model.gguf"],
     ["model.name: './nope/model.gguf' is neither a zoo model nor an existing path",
      "zoo models: smollm2-135m, smollm2-135m-moe, tiny"]),
    ("rollout-exceeds-context", ["--model.max_context=280", "--eval.max_new_tokens=8"],
     ["rollout.max_new_tokens: 32 + task.max_prompt_tokens (256) exceeds model.max_context "
      "(280)"]),
    ("eval-exceeds-context", ["--model.max_context=300", "--eval.max_new_tokens=64"],
     ["eval.max_new_tokens: 64 + task.max_prompt_tokens (256) exceeds model.max_context (300)"]),
    ("tensorboard-value", ["--log.tensorboard=maybe"],
     ["log.tensorboard: should be 'auto' or a valid boolean", "(got 'maybe')"]),
    ("run-name-path", ["--run.name=a/b"], ["run.name: 'a/b' is not a plain folder name"]),
    ("dist-address-alone", ["--dist.address=auto"],
     ["dist.address: is 'auto' but rollout_workers is 1", "remove the address"]),
    ("dist-ray-placement-one-rank", ["--dist.learner_placement=ray"],
     ["dist.learner_placement: 'ray' but learner_ranks is 1", "use 'local'"]),
    ("dist-cpus-per-local-rank", ["--dist.learner_ranks=2", "--dist.cpus_per_rank=4"],
     ["dist.cpus_per_rank: 4 applies to Ray-placed learner ranks only",
      "set learner_placement = 'ray'"]),
    ("dist-fsdp-one-rank", ["--dist.learner_strategy=fsdp"],
     ["dist.learner_strategy: 'fsdp' but learner_ranks is 1", "use 'replicate'"]),
    ("dist-fsdp-uneven", ["--dist.learner_strategy=fsdp", "--dist.learner_ranks=3",
                          "--rollout.batch_size=16", "--train.micro_batch_size=4"],
     ["dist.learner_strategy: 'fsdp' needs the 4 micro-batches", "multiple of learner_ranks (3)"]),
    ("dist-fsdp-muon", ["--dist.learner_strategy=fsdp", "--dist.learner_ranks=2",
                        "--rollout.batch_size=16", "--train.micro_batch_size=4",
                        "--train.optimizer=muon"],
     ["dist.learner_strategy: 'fsdp' with train.optimizer = 'muon'", "use 'adamw'"]),
    ("dist-fsdp-moe", ["--dist.learner_strategy=fsdp", "--dist.learner_ranks=2",
                       "--rollout.batch_size=16", "--train.micro_batch_size=4",
                       "--model.name=tiny-moe"],
     ["dist.learner_strategy: 'fsdp' with the mixture-of-experts model", "'replicate'"]),
    ("dist-placement-value", ["--dist.learner_placement=slurm"],
     ["dist.learner_placement:", "'local' or 'ray'", "slurm"]),
    ("mini-batches-uneven", ["--train.mini_batches=3"],
     ["train.mini_batches: 3 does not split the", "into equal whole parts; use one of"]),
    ("dist-too-many-ranks", ["--dist.learner_ranks=1000"],
     ["dist.learner_ranks: 1000 is more than the", "micro-batches of an optimizer step"]),
    ("missing-train", '[task]\nname = "addition"\n', ["train.steps: required but missing"]),
]


def _load(recipe, base, write_recipe):
    if isinstance(recipe, list):
        return load_config(write_recipe(base), recipe)
    return load_config(write_recipe(recipe.replace("{base}", base)))


@pytest.mark.parametrize("recipe, fragments", [row[1:] for row in BAD_RECIPES],
                         ids=[row[0] for row in BAD_RECIPES])
def test_bad_recipe_message(recipe, fragments, base_toml, write_recipe):
    """Each bad recipe raises ConfigError whose first problem line holds every fragment (the
    field path, the value seen and the hint); one mistake yields exactly one problem, except a
    recipe without [train], which misses both required keys."""
    with pytest.raises(ConfigError) as caught:
        _load(recipe, base_toml, write_recipe)
    lines = [str(problem) for problem in caught.value.problems]
    expected = 2 if fragments[0].startswith("train.steps: required") else 1
    assert len(lines) == expected, lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines)
        assert fragment in str(caught.value)


def test_rollout_workers_without_ray_names_the_extra(base_toml, write_recipe, monkeypatch):
    """dist.rollout_workers > 1, or learner ranks placed by Ray, where Ray is not installed
    fail at load time and name the extra to install."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"dist.rollout_workers: 2 needs Ray.*pip install 'qarl\[ray\]'"):
        load_config(write_recipe(base_toml), ["--dist.rollout_workers=2"])
    with pytest.raises(ConfigError, match=r"dist.learner_placement: 'ray' needs Ray.*pip install"):
        load_config(write_recipe(base_toml), ["--dist.learner_ranks=2",
                                              "--dist.learner_placement=ray"])


def test_table_is_large_enough():
    """The table covers at least 25 distinct bad recipes (issue requirement)."""
    assert len({row[0] for row in BAD_RECIPES}) == len(BAD_RECIPES) >= 25


def test_base_recipe_is_valid(base_toml, write_recipe):
    """The base every override row starts from loads cleanly, so each row's problem is its own."""
    config = load_config(write_recipe(base_toml))
    assert config.task.name == "addition" and config.train.steps == 2


def test_every_problem_at_once(base_toml, write_recipe):
    """A recipe with 3 problems in 3 different places reports all 3 in one ConfigError."""
    text = base_toml.replace("steps = 2", "steps = 2\nsetps = 3") + (
        "[rollout]\nbatch_size = 30\n\n[algo]\nloss = \"tbp\"\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(write_recipe(text))
    paths = [problem.path for problem in caught.value.problems]
    assert sorted(paths) == ["algo.loss", "rollout.batch_size", "train.setps"]
    assert str(caught.value).startswith("3 problems in ")


def test_bad_section_does_not_hide_others(base_toml, write_recipe):
    """A type error in [rollout] still lets [algo]'s registry check run and report."""
    with pytest.raises(ConfigError) as caught:
        load_config(write_recipe(base_toml), ["--rollout.top_k=-1", "--algo.loss=tbp"])
    assert [p.path for p in caught.value.problems] == ["rollout.top_k", "algo.loss"]


def test_typo_of_a_required_key(base_toml, write_recipe):
    """A misspelt required key gives both its suggestion and the missing original."""
    with pytest.raises(ConfigError) as caught:
        load_config(write_recipe(base_toml), ["--algo.overlong={l_max = 16, l_cach = 4}"])
    assert [str(p) for p in caught.value.problems] == [
        "algo.overlong.l_cach: unknown key 'l_cach'; did you mean 'l_cache'?",
        "algo.overlong.l_cache: required but missing; set it in the recipe",
    ]


def test_toml_syntax_error(write_recipe):
    """A TOML syntax error is one problem that names the file and the line."""
    with pytest.raises(ConfigError) as caught:
        load_config(write_recipe("[train]\nsteps = = 2\n", name="broken"))
    message = str(caught.value)
    assert "broken.toml" in message and "not valid TOML" in message and "line 2" in message


def test_missing_recipe_file_lists_packaged():
    """An unknown recipe name says so and lists the packaged recipes."""
    with pytest.raises(ConfigError, match="recipe file 'nosuch' not found.*default"):
        load_config("nosuch")
