"""Faults a new user hits with `qarl train` (docs/training.md, "Reliability"): every user
error is one clean message with exit status 2 and nothing written to the run folder; a resume
never deletes what it cannot read; a planted infinite learning rate is caught; races between
qarl processes and stop signals in the warm start end well. The other commands' user errors
are in test_command_faults.py. `tiny`, in process where possible (`qarl.cli.main`), in
subprocesses where processes race or get signals."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from qarl.cli import main
from qarl.lora.peft import PREFIX as PEFT_PREFIX
from qarl.paths import qarl_home
from qarl.train.trainer import train
from refusals import refused

HERE = Path(__file__).resolve().parent
SMALL = {"train.steps": 2, "rollout.batch_size": 8, "train.micro_batch_size": 8,
         "eval.size": 8, "eval.full_precision": False, "log.plot": False,
         "train.checkpoint_every": 1, "train.keep_checkpoints": 4}


def _overrides(out: Path, **extra) -> list[str]:
    values = {**SMALL, "run.output_dir": str(out), **extra}
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]


# ---- user errors: one clean message, exit 2, nothing written --------------------------


@pytest.fixture
def bad_inputs(tmp_path, tiny_dir):
    """Broken versions of what a user points qarl at, each in its own place."""
    empty = tmp_path / "not_a_model"
    empty.mkdir()
    cut = tmp_path / "cut_model"
    shutil.copytree(tiny_dir, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    gguf = tmp_path / "garbage.gguf"
    gguf.write_bytes(b"this is no gguf file" * 10)
    junk = tmp_path / "junk.jsonl"
    junk.write_text('{"prompt": ""}\nnot json\n')
    no_eval = tmp_path / "no_eval.jsonl"  # by the prompts' hashes, all 40 land in train
    no_eval.write_text("".join(f'{{"prompt": "{a}+1", "answer": "{a + 1}"}}\n' for a in range(40)))
    rewards = tmp_path / "fault_rewards.py"
    rewards.write_text("def exact(prompt, completion, answer=None, **fields):\n    return 1.0\n\n"
                       "def one_arg(prompt):\n    return 1.0\n\nNOT_CALLABLE = 3\n")
    (tmp_path / "raising_rewards.py").write_text(
        "import os\n\nraise RuntimeError('planted at import')\n\n"
        "def fn(prompt, completion, **fields):\n    return 1.0\n")
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    no_completion = tmp_path / "no_completion.jsonl"  # prompt and answer: nothing to imitate
    no_completion.write_text("".join(f'{{"prompt": "{a}+{b}", "answer": "{a + b}"}}\n'
                                     for a in range(10) for b in range(10)))
    peft_list = tmp_path / "peft_list"
    peft_list.mkdir()
    (peft_list / "adapter_config.json").write_text("[]")
    (peft_list / "adapter_model.safetensors").write_bytes(b"")
    peft_cut = tmp_path / "peft_cut"
    peft_cut.mkdir()
    (peft_cut / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    adapter = peft_cut / "adapter_model.safetensors"
    save_file({f"{PEFT_PREFIX}model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 256)},
              adapter)
    adapter.write_bytes(adapter.read_bytes()[:-100])
    return {"empty": empty, "cut": cut, "gguf": gguf, "junk": junk, "no_eval": no_eval,
            "rewards": rewards, "file": a_file, "no_completion": no_completion,
            "peft_list": peft_list, "peft_cut": peft_cut}


CASES = {  # name -> (extra overrides, what the message must say)
    "model folder that is not a model": ({"model.name": "{empty}"}, "has no config.json"),
    "model.safetensors cut short": ({"model.name": "{cut}"}, "model.safetensors is cut short"),
    "garbage gguf": ({"model.name": "{gguf}"}, "garbage.gguf is not a GGUF file"),
    "scheme option value": ({"quant.scheme": "w4a16-int4", "quant.options": "{{group_size = 7}}"},
                            "group_size=7; valid: [32, 64, 128]"),
    "task option out of range": ({"task.options": "{{digits = 99}}"}, "digits must be an integer"),
    "dataset with no usable row": ({"task.name": "", "task.options": "", "task.dataset": "{junk}"},
                                   "no usable rows in dataset"),
    "dataset with no eval split": ({"task.name": "", "task.options": "", "task.dataset": "{no_eval}"},
                                   "the eval split of"),
    "reward module missing": ({"task.reward": "no_such_module_q:fn"}, "was not found"),
    "reward function missing": ({"task.reward": "fault_rewards:missing"},
                                "'fault_rewards' has no attribute 'missing'; public names there: "
                                "['NOT_CALLABLE', 'exact', 'one_arg']"),
    "reward that is not a function": ({"task.reward": "fault_rewards:NOT_CALLABLE"},
                                      "is a int, not a function"),
    "reward of the wrong signature": ({"task.reward": "fault_rewards:one_arg"},
                                      "reward 'fault_rewards:one_arg'(prompt) cannot take a call "
                                      "(prompt, completion, **fields) with this task's fields "
                                      "['answer']: too many positional arguments"),
    "reward module that raises at import": (
        {"task.reward": "raising_rewards:fn"},
        "importing reward module 'raising_rewards' raised RuntimeError: planted at import (at "),
    "run folder under a file": ({"run.output_dir": "{file}/runs"}, "a_file is a file"),
    "evaluation cache under a file": ({"eval.cache_dir": "{file}/cache"},
                                      "a_file is a file, so the evaluation cache"),
    "dataset without completions for the warm start": (
        {"task.name": "", "task.options": "", "task.dataset": "{no_completion}"},
        "which the warm start (sft.steps = 7) trains on; add a 'completion' column (a whole "
        "response the reward scores 1.0), or set sft.steps = 0"),
    "PEFT config that is no object": ({"lora.rank": "4", "lora.init_from": "{peft_list}"},
                                      "adapter_config.json holds a JSON list, not the object"),
    "PEFT adapters cut short": ({"lora.rank": "4", "lora.init_from": "{peft_cut}"},
                                "adapter_model.safetensors is cut short"),
    "infinite learning rate": ({"train.lr": "inf"}, "train.lr: is inf"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_user_errors_are_one_message_before_any_work(case, bad_inputs, tmp_path, capsys,
                                                     monkeypatch):
    """Each user error found after parsing the recipe (a model, dataset, reward, option value
    or run folder that cannot work) ends `qarl train` with its file, key or value named, exit
    status 2, no traceback, before the warm start and with no run folder written."""
    monkeypatch.syspath_prepend(str(tmp_path))  # where fault_rewards.py lives
    extra, expected = CASES[case]
    extra = {k: v.format(**bad_inputs) for k, v in extra.items()}
    out, sft = tmp_path / "runs", qarl_home() / "sft"
    cached = set(sft.iterdir()) if sft.is_dir() else set()
    err = refused(capsys, "train", "tiny", *_overrides(out, **extra), "--sft.steps=7")
    assert expected in err
    assert not out.exists()
    assert (set(sft.iterdir()) if sft.is_dir() else set()) == cached  # no warm start ran


def test_a_reward_that_fails_on_every_call_stops_the_run(tmp_path, capsys, monkeypatch):
    """A reward that raises on every call: the evaluation before step 1 is the run's first
    batch, all of it fails, so the run stops there (exit status 2) naming the reward, the
    exception and the line that raised it, with the error kept in reward_errors.txt once;
    nothing was trained, no checkpoint written."""
    (tmp_path / "boom_rewards.py").write_text(
        "def boom(prompt, completion, **fields):\n"
        "    raise RuntimeError('planted: the reward is broken')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    err = refused(capsys, "train", "tiny", *_overrides(tmp_path / "runs"),
                   "--task.reward=boom_rewards:boom")
    assert ("every one of the 8 reward calls of the quantized evaluation failed (8 errors, 0 "
            "timeouts)") in err
    assert "'boom_rewards:boom' gave RuntimeError: planted: the reward is broken (at " in err
    assert "boom_rewards.py:2 in boom)" in err
    run = tmp_path / "runs" / "tiny"
    lines = (run / "reward_errors.txt").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("the quantized evaluation: RuntimeError")
    assert not list(run.glob("step_*"))


def test_read_only_run_folder_isrefused(tmp_path, capsys, monkeypatch):
    """A run folder on a disk that takes no writes is refused at load, naming the folder."""
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == str(tmp_path)
                        else real_access(path, mode))
    err = refused(capsys, "train", "tiny", *_overrides(tmp_path))
    assert f"{tmp_path} cannot be written" in err


def test_other_commands_refuse_cleanly(tmp_path, capsys):
    """A recipe that is not UTF-8 or is a folder, `qarl sft` with a misspelled key or no
    steps to run, `qarl export` into a file: one message each, exit status 2."""
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"[train]\nsteps = 1\nlr = 1e-5\n# caf\xe9\n")
    assert "not UTF-8 text (byte 0xe9" in refused(capsys, "train", str(latin1))
    assert "is a folder, not a recipe file" in refused(capsys, "sft", str(tmp_path))
    assert "did you mean 'steps'" in refused(capsys, "sft", "tiny", "--sft.stpes=3")
    err = refused(capsys, "sft", "tiny", "--sft.steps=0")
    assert "has sft.steps = 0: there is no warm start to run; set --sft.steps=N" in err
    (tmp_path / "out_file").write_text("x")
    err = refused(capsys, "export", str(tmp_path), str(tmp_path / "out_file"), "--format", "hf")
    assert "out_file is a file" in err


# ---- resume never deletes a run ---------------------------------------------------------


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".lock"}


def test_resume_on_damaged_checkpoints_loses_nothing(tmp_path, capsys):
    """A run with 2 checkpoints: with the weights of the newest cut short, `--resume` names it,
    sets it aside (damaged_step_000002) and resumes from step 1, ending at step 2 like an
    uninterrupted run; with every checkpoint damaged (a file missing from each) both
    `--resume` and the recipe again refuse with exit 2 and leave every file as it was."""
    run = tmp_path / "tiny"
    train("tiny", {**SMALL, "run.output_dir": str(tmp_path)})
    reference = (run / "step_000002" / "model.safetensors").read_bytes()
    weights = run / "step_000002" / "model.safetensors"
    half = weights.stat().st_size // 2
    weights.write_bytes(weights.read_bytes()[:half])
    assert main(["train", "--resume", str(run)]) == 0
    err = capsys.readouterr().err
    assert "passed over step_000002" in err and "cut short" in err
    assert (run / "damaged_step_000002" / "model.safetensors").stat().st_size == half
    assert (run / "step_000002" / "model.safetensors").read_bytes() == reference

    for folder in run.glob("step_*"):
        (folder / "optimizer.safetensors").unlink()
    before = _tree(run)
    err = refused(capsys, "train", "--resume", str(run))
    assert "none can be resumed" in err and "missing optimizer.safetensors" in err
    err = refused(capsys, "train", "tiny", *_overrides(tmp_path))
    assert "Nothing was changed" in err
    assert _tree(run) == before


def test_resume_of_checkpoints_that_do_not_fit_changes_nothing(tmp_path, capsys):
    """A run folder whose checkpoints hold weights of another shape (as a checkpoint copied
    from another model's run would): `--resume` is refused with exit status 2 naming the file,
    the tensor and both shapes, and every file of the run is left as it was."""
    from safetensors.torch import load_file

    run = tmp_path / "tiny"
    train("tiny", {**SMALL, "run.output_dir": str(tmp_path)})
    for folder in run.glob("step_*"):  # an embedding one row longer
        weights = load_file(folder / "model.safetensors")
        embedding = weights["model.embed_tokens.weight"]
        weights["model.embed_tokens.weight"] = torch.zeros(embedding.shape[0] + 1, embedding.shape[1])
        save_file(weights, folder / "model.safetensors")
    before = _tree(run)
    err = refused(capsys, "train", "--resume", str(run))
    assert (f"{run / 'step_000002' / 'model.safetensors'} does not fit this model: 1 of another "
            "shape (e.g. model.embed_tokens.weight: [") in err
    assert f"Nothing was deleted; move step_000002 out of {run} to resume from an earlier" in err
    assert _tree(run) == before


def test_a_weights_only_final_checkpoint_ends_the_run_and_loses_nothing(tmp_path, capsys):
    """train.final_checkpoint = 'weights': the last step's checkpoint has no optimizer file
    while the one before is full; `--resume` at the run's own length only evaluates again (the
    weights untouched); asking for more steps is refused with exit 2 and every file left as it
    was; `qarl export` still writes the policy."""
    run = tmp_path / "tiny"
    train("tiny", {**SMALL, "run.output_dir": str(tmp_path), "train.final_checkpoint": "weights"})
    assert (run / "step_000001" / "optimizer.safetensors").is_file()
    assert not (run / "step_000002" / "optimizer.safetensors").exists()
    weights = (run / "step_000002" / "model.safetensors").read_bytes()
    assert main(["train", "--resume", str(run)]) == 0
    capsys.readouterr()
    assert (run / "step_000002" / "model.safetensors").read_bytes() == weights
    before = _tree(run)
    err = refused(capsys, "train", "--resume", str(run), "--train.steps=3")
    assert "saved without optimizer state" in err and "Nothing was changed" in err
    assert _tree(run) == before
    assert main(["export", str(run), str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_resume_of_a_folder_without_checkpoints_starts_its_run(tmp_path, capsys):
    """`--resume` on a run folder that never saved a checkpoint (a run stopped in its warm
    start) starts that run with its saved recipe, saying so."""
    from qarl.config import load_config, save_resolved

    save_resolved(load_config("tiny", {"run.output_dir": str(tmp_path), **{
        k: v for k, v in SMALL.items()}}), tmp_path / "tiny")
    assert main(["train", "--resume", str(tmp_path / "tiny")]) == 0
    err = capsys.readouterr().err
    assert "no checkpoint yet" in err and "the run starts from step 1" in err
    assert (tmp_path / "tiny" / "step_000002").is_dir()


def test_a_planted_infinite_learning_rate_skips_the_step(tmp_path, monkeypatch):
    """An lr the schedule turns infinite (a planted bug: the recipe refuses inf) skips the
    step like a non-finite loss: guard/nonfinite = 1, weights and optimizer state untouched,
    and the run goes on; the final weights are finite."""
    import qarl.train.learner.update as update
    from qarl.report import read_metrics

    real = update.learning_rate
    monkeypatch.setattr(update, "learning_rate",
                        lambda step, *a: float("inf") if step == 1 else real(step, *a))
    train("tiny", {**SMALL, "run.output_dir": str(tmp_path), "train.steps": 3})
    rows = [r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if "guard/nonfinite" in r]
    assert [r["guard/nonfinite"] for r in rows] == [0.0, 1.0, 0.0]
    from safetensors.torch import load_file

    step1 = load_file(tmp_path / "tiny" / "step_000001" / "model.safetensors")
    step2 = load_file(tmp_path / "tiny" / "step_000002" / "model.safetensors")
    assert all(torch.equal(step1[k], step2[k]) for k in step1)
    final = load_file(tmp_path / "tiny" / "step_000003" / "model.safetensors")
    assert all(bool(torch.isfinite(v).all()) for v in final.values())


# ---- processes that race, signals in the warm start -------------------------------------


def _qarl(*argv: str, env: dict, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qarl.cli", *argv], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_two_first_runs_on_an_empty_qarl_home_both_finish(tmp_path):
    """Two `qarl sft tiny` started together on an empty $QARL_HOME (both must prepare the tiny
    model, then run the same warm start): both finish with exit 0 and print the same cache
    folder, which holds one complete warm start; no temporary folder is left behind."""
    env = {"QARL_HOME": str(tmp_path / "home")}
    runs = [_qarl("sft", "tiny", "--sft.steps=3", env=env) for _ in range(2)]
    outputs = [run.communicate(timeout=600) for run in runs]
    for run, (out, err) in zip(runs, outputs):
        assert run.returncode == 0, err
    folders = [out.strip().splitlines()[-1] for out, _ in outputs]
    assert folders[0] == folders[1] and (Path(folders[0]) / "model.safetensors").is_file()
    leftovers = [p.name for p in (tmp_path / "home").rglob(".*") if p.is_dir()]
    assert leftovers == [], leftovers


def test_sigterm_in_the_warm_start_stops_within_seconds(tmp_path, tiny_dir):
    """SIGTERM during a long warm-start SFT ends the run within 5 s, exit status 143, with a
    message saying nothing was saved and how to start again; no SFT cache entry is left, and
    the run folder holds the recipe only, so `--resume` starts the run."""
    home = tmp_path / "home"
    (home / "models").mkdir(parents=True)
    shutil.copytree(tiny_dir, home / "models" / "tiny")
    (home / "models" / "tiny" / "qarl_zoo.json").write_text('{"name": "tiny", "family": "qwen3"}\n')
    if (qarl_home() / "kernels").is_dir():  # compiled already: the signal meets the SFT loop
        shutil.copytree(qarl_home() / "kernels", home / "kernels")
    run = _qarl("train", "tiny", *_overrides(tmp_path / "runs"), "--sft.steps=100000",
                env={"QARL_HOME": str(home)})
    deadline = time.monotonic() + 120
    while not (home / "sft").is_dir() or not any((home / "sft").glob(".*.lock")):
        assert run.poll() is None, run.communicate()[1]
        assert time.monotonic() < deadline, "the warm start did not begin"
        time.sleep(0.05)
    time.sleep(1.0)  # inside the SFT loop (the lock is taken just before it)
    start = time.monotonic()
    run.send_signal(signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 143, err
    assert time.monotonic() - start < 5
    assert "stopped before the first RL step" in err and "Traceback" not in err
    assert f"qarl train --resume {tmp_path / 'runs' / 'tiny'}" in err
    assert [p.name for p in (home / "sft").iterdir() if not p.name.startswith(".")] == []
    assert sorted(p.name for p in (tmp_path / "runs" / "tiny").iterdir()
                  if not p.name.startswith(".")) == ["config.toml"]


@pytest.mark.parametrize("moment", ["while starting", "after the start-up lines"])
def test_sigint_to_the_process_group_at_any_moment_is_a_clean_stop(tmp_path, moment):
    """Ctrl-C (SIGINT to the whole process group, reward workers included) while the command
    still imports and loads, or right after the run's start-up lines (the contract and the
    gradient pass printed, no step begun): exit status 130, one message, no traceback."""
    run = _qarl("train", "tiny", *_overrides(tmp_path / "runs"), env={},
                start_new_session=True)
    if moment == "while starting":
        time.sleep(0.5)
    else:
        for line in run.stderr:
            if line.startswith("learner on"):
                break
    os.killpg(run.pid, signal.SIGINT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "SIGINT" in err.strip().splitlines()[-1]
