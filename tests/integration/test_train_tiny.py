"""End-to-end RL on the `tiny` model (tiny.toml): the loop, its invariants and resume."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from qarl.config import load_config
from qarl.report import read_metrics
from qarl.train.folder import open_run
from qarl.train.sft import warm_start
from qarl.train.trainer import rl_step, train


def _overrides(tmp_path, **extra):
    return {"run.output_dir": str(tmp_path), "log.progress": False, **extra}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One full run of tiny.toml (the CI-sized recipe), shared by the tests that read it."""
    out = tmp_path_factory.mktemp("runs")
    summary = train("tiny", _overrides(out))
    return summary, read_metrics(out / "tiny" / "metrics.jsonl")


def test_tiny_recipe_trains_and_reward_rises(tiny_run):
    """The tiny recipe runs end to end and the policy improves on what it trains on: the
    mean reward of its last quarter of steps beats that of its first quarter by a margin
    (each step averages 64 samples; measured 0.08 -> 0.15)."""
    summary, rows = tiny_run
    rewards = [r["reward/mean"] for r in rows if r["kind"] == "train"]
    assert len(rewards) == load_config("tiny").train.steps
    quarter = len(rewards) // 4
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last > first + 0.03, rewards
    assert 0.0 <= summary["after"]["eval/accuracy_quantized"] <= 1.0


def test_kernel_alignment_mismatch_is_exactly_zero(tiny_run):
    """With w8a8-int8 and `kernel` alignment, old_logp equals the sampler's logprobs bit for
    bit at every step: the logged max |old_logp - rollout_logp| is exactly 0."""
    _, rows = tiny_run
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["mismatch/abs_diff_max"] for r in train_rows] == [0.0] * len(train_rows)


def test_eval_rows_time_each_policy(tiny_run):
    """Every evaluation row says how long each evaluated policy took (generate + score), one
    `time/eval_*` per policy with an accuracy, so an eval's share of a run's wall is read off
    metrics.jsonl."""
    _, rows = tiny_run
    evals = [r for r in rows if r["kind"] == "eval"]
    assert len(evals) >= 2  # before and after
    for row in evals:
        policies = sorted(k[len("eval/accuracy_"):] for k in row if k.startswith("eval/accuracy_"))
        timed = sorted(k[len("time/eval_"):] for k in row if k.startswith("time/eval_"))
        assert timed == policies and policies, row
        assert all(row[f"time/eval_{p}"] > 0 for p in policies)


def test_run_leaves_its_artifacts(tiny_run, tmp_path):
    """A run folder holds the resolved config, metrics, a checkpoint and the summary."""
    summary, _ = tiny_run
    from pathlib import Path

    run_dir = Path(summary["run_dir"])
    for name in ("config.toml", "metrics.jsonl", "summary.json"):
        assert (run_dir / name).exists(), name
    assert sorted(p.name for p in run_dir.glob("step_*"))


def _one_update(config, micro_batch_size):
    """Weights before and after one RL step (`rl_step`, step 1: step 0's 8 samples all score
    0) of the warm-started tiny model with this micro-batch size."""
    config = config.model_copy(update={"train": config.train.model_copy(
        update={"micro_batch_size": micro_batch_size})})
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        before = {n: p.detach().clone() for n, p in policy.learner.model.named_parameters()}
        metrics = rl_step(policy, data, config, step=1)
        assert metrics["groups/all_equal_frac"] < 1.0, "no reward spread: the update would be trivial"
        assert metrics["policy/skipped_steps"] == 0
        return before, {n: p.detach().clone() for n, p in policy.learner.model.named_parameters()}


@pytest.mark.parametrize("backward", ["float", "codes"])
def test_micro_batching_does_not_change_the_update(tmp_path, backward):
    """Micro-batch 4 x accumulation 2 gives the same update as micro-batch 8 x 1, and the update
    changes every parameter that should train. With the float backward, within 2e-5 = lr / 15
    (measured 3e-7: the gradients differ only in the order of their float sums, ~1e-7
    relative, but Adam divides each coordinate by its own gradient scale, so coordinates whose
    gradient is near rounding noise move by a visible fraction of lr). With the backward on
    codes those last-bit differences can flip an int8 rounding of g, which the layers below
    carry on: another draw of the codes' ~1% rounding noise, not a change of the update's
    content (measured: 1.7% of the update's norm, 99.99% of the large moves in the same
    direction, norms equal within 1e-5; bounds 5%, 99%, 1e-3). In the fp32 gradient pass these
    bounds are reasoned for ('auto' is bf16 on CPUs with AMX-BF16)."""
    config = load_config("tiny", _overrides(tmp_path, **{"rollout.batch_size": 8,
                                                         "train.micro_batch_size": 8,
                                                         "train.quant_backward": backward,
                                                         "train.compute_dtype": "float32"}))
    before, whole = _one_update(config, 8)
    _, split = _one_update(config, 4)
    if backward == "float":
        for name in whole:
            assert torch.allclose(whole[name], split[name], atol=2e-5, rtol=0), name
    else:
        a = torch.cat([(whole[n] - before[n]).flatten() for n in whole])
        b = torch.cat([(split[n] - before[n]).flatten() for n in whole])
        assert (a - b).norm() <= 0.05 * a.norm()
        assert abs(a.norm() - b.norm()) <= 1e-3 * a.norm()
        big = a.abs() > 0.5 * a.abs().max()
        assert (torch.sign(a) == torch.sign(b))[big].float().mean() >= 0.99
    unchanged = [n for n in whole if torch.equal(whole[n], before[n])]
    assert unchanged == []


_SMALL = {"train.steps": 3, "eval.size": 8, "eval.full_precision": False, "log.plot": False}


def _final_weights(run_dir):
    from qarl.train.checkpoint import latest

    return load_file(latest(run_dir) / "model.safetensors")


def test_killed_run_resumes_to_the_same_weights(tmp_path):
    """A run stopped after step 2 and resumed from its checkpoint ends with exactly the
    weights of an uninterrupted 3-step run: data, sampling seeds and optimizer state are all
    restored (the data of a step is a pure function of seed and step)."""
    whole = tmp_path / "whole"
    every_step = {**_SMALL, "train.checkpoint_every": 1}
    train("tiny", _overrides(whole, **every_step))
    parts = tmp_path / "parts"
    train("tiny", _overrides(parts, **{**every_step, "train.steps": 2}))
    train("tiny", _overrides(parts, **every_step))
    a, b = _final_weights(whole / "tiny"), _final_weights(parts / "tiny")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    resumed_rows = [r for r in read_metrics(parts / "tiny" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in resumed_rows] == [1, 2, 3]
    # a fresh start in the same folder (resume off) starts the metrics over too
    train("tiny", _overrides(parts, **{**every_step, "run.resume": False, "train.steps": 1}))
    fresh_rows = [r for r in read_metrics(parts / "tiny" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["step"] for r in fresh_rows] == [1]


def test_a_failed_audit_keeps_full_replay_across_a_resume(tmp_path):
    """A run whose audit found a difference replays every row from then on, also after a
    resume: the flag is part of its checkpoint (here planted in the saved state)."""
    import json

    from qarl.train.checkpoint import latest

    every_step = {**_SMALL, "train.checkpoint_every": 1, "train.audit_full_every": 0}
    train("tiny", _overrides(tmp_path, **{**every_step, "train.steps": 1}))
    state_file = latest(tmp_path / "tiny") / "state.json"
    state = json.loads(state_file.read_text())
    assert state["full_replay"] is False
    state_file.write_text(json.dumps({**state, "full_replay": True}))
    train("tiny", _overrides(tmp_path, **{**every_step, "train.steps": 2}))
    rows = [r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if r["kind"] == "train"]
    assert [(r["step"], r["audit/replayed_frac"], r["audit/full_replay"]) for r in rows] == [
        (1, 1 / 8, 0.0), (2, 1.0, 1.0)]
    assert json.loads((latest(tmp_path / "tiny") / "state.json").read_text())["full_replay"]


def test_zero_learning_rate_keeps_codes_and_exact_parity(tmp_path):
    """With lr = 0 every step re-exports the weights, yet no engine code changes and the
    learner's old_logp still equals the sampler's logprobs exactly at every step. With two
    epochs, the second epoch's logp (replayed after an optimizer step that changed nothing)
    gives a sequence ratio of exactly 1: its value comes from the exact path, not the fast
    full-sequence forward (which is ~1e-4 off for int8)."""
    train("tiny", _overrides(tmp_path, **{**_SMALL, "train.lr": 0.0, "algo.epochs": 2}))
    rows = [r for r in read_metrics(tmp_path / "tiny" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["sync/changed_code_frac"] for r in rows] == [0.0] * len(rows)
    assert [r["mismatch/abs_diff_max"] for r in rows] == [0.0] * len(rows)
    assert [(r["loss/seq_ratio_min"], r["loss/seq_ratio_max"]) for r in rows] == [(1.0, 1.0)] * len(rows)
    assert all(r["sync/seconds"] > 0 for r in rows)


def test_one_process_per_run_folder(tmp_path):
    """A second run in the folder of a live run fails at once with a message that says what
    to do; once the first run is closed the folder is free again."""
    from qarl.errors import UserError
    from qarl.train.folder import lock_run_dir

    with open_run(load_config("tiny", _overrides(tmp_path))) as (folder, _, _):
        with pytest.raises(UserError, match="another qarl process is running in .*--run.name"):
            lock_run_dir(folder.path)
    lock_run_dir(folder.path).close()
