"""One-step-off-policy rollouts (train.async_rollouts) on the `tiny` recipe: staleness 0 is the
synchronous run bit for bit, staleness 1 samples each batch with the previous weights, and a
stopped or extended async run resumes as the uninterrupted one."""

from __future__ import annotations

import copy
import signal

import pytest
import torch
from safetensors.torch import load_file

from qarl.config import load_config
from qarl.report import read_metrics
from qarl.train import signals
from qarl.train.checkpoint import PENDING, latest
from qarl.train.folder import open_run
from qarl.train.guards import RunStopped
from qarl.train.learner import learner as learner_module
from qarl.train.sft import warm_start
from qarl.train.trainer import async_rollouts, generate, rl_step, step_prompts, train

RUN = {"train.steps": 3, "rollout.batch_size": 16, "train.micro_batch_size": 8,
       "train.checkpoint_every": 1, "train.keep_checkpoints": 3, "eval.size": 8,
       "eval.full_precision": False, "log.plot": False, "log.progress": False}
ASYNC = {"train.async_rollouts": True}
# metrics that are functions of the run's bits (not of its timing)
EXACT = ("reward/mean", "mismatch/abs_diff_max", "mismatch/abs_diff_mean", "policy/grad_norm",
         "async/staleness", "audit/stale")


def _run(folder, **extra) -> list[dict]:
    train("tiny", {"run.output_dir": str(folder), **RUN, **extra})
    return [r for r in read_metrics(folder / "tiny" / "metrics.jsonl") if r["kind"] == "train"]


def _weights(folder):
    return load_file(latest(folder / "tiny") / "model.safetensors")


def _same_weights(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def one_step_off(tmp_path_factory):
    """The 3-step run with staleness 1, uninterrupted."""
    folder = tmp_path_factory.mktemp("async1")
    return folder, _run(folder, **ASYNC)


def test_staleness_zero_gives_the_synchronous_weights_bit_for_bit(tmp_path):
    """The async path with staleness 0 (each batch generated in the background with the
    current weights, then trained on) ends with the synchronous run's weights, torch.equal on
    every parameter, and the same metrics at every step."""
    sync_rows = _run(tmp_path / "sync")
    zero_rows = _run(tmp_path / "zero", **ASYNC, **{"train.async_staleness": 0})
    assert _same_weights(_weights(tmp_path / "sync"), _weights(tmp_path / "zero"))
    for a, b in zip(sync_rows, zero_rows, strict=True):
        assert all(a.get(k) == b.get(k) for k in ("reward/mean", "mismatch/abs_diff_max",
                                                  "policy/grad_norm")), (a, b)
    assert all(r["async/staleness"] == 0.0 and r["audit/stale"] == 0.0 for r in zero_rows)


def test_staleness_one_trains_on_batches_of_the_previous_weights(one_step_off):
    """Steps 2 and 3 train on batches sampled one version back: staleness 1, old_logp is the
    learner's whole replay (`audit/stale`), and the mismatch shows the update between the
    versions once one moved the codes; step 1's batch is the learner's own, audited, exact.
    Every checkpoint holds the next step's batch."""
    folder, rows = one_step_off
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0]
    assert [r["audit/stale"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[0]["mismatch/abs_diff_max"] == 0.0 and rows[0]["audit/failed"] == 0.0
    assert any(r["mismatch/abs_diff_max"] > 0 for r in rows[1:])
    assert all("contract/over_budget" not in r or r["contract/over_budget"] is None
               for r in rows[1:])
    for step in (1, 2, 3):
        assert (folder / "tiny" / f"step_{step:06d}" / PENDING).is_file()


def test_a_stop_in_the_update_saves_the_pending_batch_and_resumes_exactly(one_step_off,
                                                                          tmp_path,
                                                                          monkeypatch):
    """A stop signal that arrives during step 2's update, while step 3's batch is generated in
    the background: the step finishes, the run stops with the checkpoint of 2 steps (with
    step 3's batch), and the resumed run ends with the uninterrupted run's weights and
    step-3 metrics, bit for bit."""
    folder, rows = one_step_off
    update = learner_module.update_policy

    def stopping(passes, optimizers, group, exp, algo, train_section, step):
        metrics = update(passes, optimizers, group, exp, algo, train_section, step)
        if step == 1:
            signals._received = signal.SIGTERM  # as the handler records a signal
        return metrics

    monkeypatch.setattr(learner_module, "update_policy", stopping)
    with pytest.raises(RunStopped) as stopped:
        _run(tmp_path, **ASYNC)
    assert stopped.value.checkpoint.name == "step_000002"
    assert (stopped.value.checkpoint / PENDING).is_file()
    monkeypatch.setattr(learner_module, "update_policy", update)
    resumed = _run(tmp_path, **ASYNC)
    assert _same_weights(_weights(folder), _weights(tmp_path))
    assert all(resumed[2].get(k) == rows[2].get(k) for k in EXACT), (resumed[2], rows[2])


def test_an_extended_async_run_continues_as_the_longer_run(one_step_off, tmp_path):
    """A 2-step async run (its last step generates the batch after it: the final checkpoint
    is full) extended to 3 steps ends with the 3-step run's weights bit for bit."""
    folder, rows = one_step_off
    _run(tmp_path, **ASYNC, **{"train.steps": 2})
    extended = _run(tmp_path, **ASYNC)
    assert _same_weights(_weights(folder), _weights(tmp_path))
    assert all(extended[2].get(k) == rows[2].get(k) for k in EXACT)


def test_the_next_batch_is_what_the_engine_samples_with_the_previous_weights(tmp_path):
    """Through rl_step: the batch generated during step 1 (for step 2) equals, token and
    logprob, what the engine samples for step 2 with the weights it held before step 1's
    update, and differs from what it samples after the push; step 2 then replays it with the
    learner's new weights (staleness 1, a mismatch above 0)."""
    config = load_config("tiny", {"run.output_dir": str(tmp_path), **RUN, **ASYNC})
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        policy.sync.push()
        _, prompts = step_prompts(data, config, 2)
        before = generate(policy, config, 2, prompts)  # step 2's batch with the weights W_1
        rollouts = async_rollouts(policy, data, config)
        try:
            rl_step(policy, data, config, 1, rollouts)
            after = generate(policy, config, 2, prompts)  # with the weights W_2
            pending = rollouts.pending
            assert (pending.step, pending.version) == (2, 1)
            assert torch.equal(pending.batch.response_ids, before.response_ids)
            assert torch.equal(pending.batch.rollout_logp, before.rollout_logp)
            assert not torch.equal(after.rollout_logp, before.rollout_logp)
            metrics = rl_step(policy, data, config, 2, rollouts)
        finally:
            rollouts.close()
    assert metrics["async/staleness"] == 1.0 and metrics["audit/stale"] == 1.0
    assert metrics["mismatch/abs_diff_max"] > 0
