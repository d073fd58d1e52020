"""Guards of the training loop: non-finite updates, bad steps in a row, stop signals, out of
memory, and what a resumed run may change."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch
from torch import nn

from qarl.config import ConfigError, load_config, save_resolved, to_toml
from qarl.errors import UserError
from qarl.train import checkpoint
from qarl.train.guards import (
    BadStepGuard, NonFiniteWeights, RunStopped, TrainingAborted, check_weights,
    is_out_of_memory, out_of_memory_message,
)
from qarl.train.learner.update import optimizer_step
from qarl.train.resume import check_resumable, resume_config
from qarl.train.signals import StopRequested, check_stop, stop_on_signals


def _stepped_model():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, [opt]


def _snapshot(model, opts):
    state = opts[0].state_dict()["state"]
    return ([p.detach().clone() for p in model.parameters()],
            {(pid, k): v.clone() for pid, s in state.items() for k, v in s.items()})


@pytest.mark.parametrize("plant", ["nan_gradient", "inf_gradient", "nonfinite_loss"])
def test_a_nonfinite_update_leaves_weights_and_optimizer_untouched(plant):
    """A NaN or inf in the gradient, or a loss reported non-finite: no optimizer step; every
    weight and every Adam moment / step count is bit-identical afterwards; gradients cleared."""
    model, opts = _stepped_model()
    before = _snapshot(model, opts)
    (model(torch.randn(2, 4)) ** 2).sum().backward()
    if plant != "nonfinite_loss":
        model.weight.grad[0, 0] = float("nan") if plant == "nan_gradient" else float("inf")
    _, outcome = optimizer_step(model, opts, grad_clip=1.0, loss_finite=plant != "nonfinite_loss")
    after = _snapshot(model, opts)
    assert outcome == "nonfinite"
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert before[1].keys() == after[1].keys()
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("setting, value", [("lr", float("inf")), ("weight_decay", float("nan")),
                                            ("betas", (0.9, float("inf")))])
def test_a_nonfinite_optimizer_setting_skips_the_step(setting, value):
    """A non-finite number among the optimizer's settings (the learning rate a schedule sets,
    weight decay, betas): the step is skipped like a non-finite gradient, weights and Adam
    state bit-identical."""
    model, opts = _stepped_model()
    before = _snapshot(model, opts)
    opts[0].param_groups[0][setting] = value
    model(torch.randn(2, 4)).sum().backward()
    assert optimizer_step(model, opts, grad_clip=1.0)[1] == "nonfinite"
    after = _snapshot(model, opts)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])


def test_weights_left_nonfinite_by_a_step_stop_the_run(monkeypatch):
    """An optimizer step that leaves a weight non-finite with finite inputs (a planted fault)
    raises NonFiniteWeights naming the tensor, before the weights go anywhere; huge but finite
    weights (whose L2 norm overflows) pass."""
    model, opts = _stepped_model()
    real_step = opts[0].step

    def faulty_step(*args, **kwargs):
        real_step(*args, **kwargs)
        with torch.no_grad():
            model.bias[1] = float("nan")

    monkeypatch.setattr(opts[0], "step", faulty_step)
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(NonFiniteWeights, match=r"1 weight tensors non-finite \(e.g. \['bias'\]\)"):
        optimizer_step(model, opts, grad_clip=1.0)
    with torch.no_grad():
        model.bias.fill_(3e38)  # finite; the norm of three of them overflows float32
    check_weights(list(model.named_parameters()))


def test_zero_and_finite_gradients():
    """An exactly-zero gradient takes no step ("zero"); a finite one steps ("stepped")."""
    model, opts = _stepped_model()
    before = _snapshot(model, opts)
    (model(torch.randn(2, 4)) * 0).sum().backward()
    assert optimizer_step(model, opts, grad_clip=1.0)[1] == "zero"
    assert all(torch.equal(a, b) for a, b in zip(before[0], _snapshot(model, opts)[0]))
    model(torch.randn(2, 4)).sum().backward()
    assert optimizer_step(model, opts, grad_clip=1.0)[1] == "stepped"


def test_bad_steps_in_a_row_abort_with_what_to_check():
    """K non-finite steps in a row abort with a message naming the setting and what to
    check; a good step in between resets the count."""
    guard = BadStepGuard(limit=2)
    bad, good = {"guard/nonfinite": 1.0}, {"guard/nonfinite": 0.0}
    guard.update(1, bad, None)
    guard.update(2, good, None)
    guard.update(3, bad, None)
    with pytest.raises(TrainingAborted) as err:
        guard.update(4, bad, Path("runs/x/step_000002"))
    message = str(err.value)
    for part in ("steps 3-4", "train.max_bad_steps = 2", "train.lr", "runs/x/step_000002"):
        assert part in message


def test_stop_signals_set_a_flag_and_a_second_acts_as_usual():
    """Inside stop_on_signals a SIGTERM only sets the flag check_stop raises on (the process
    lives on); the previous handlers are back after the first signal and after the block; a
    stopped run exits 128 + the signal number (143 SIGTERM, 130 SIGINT)."""
    seen = []
    sigint = signal.getsignal(signal.SIGINT)
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with stop_on_signals():
            check_stop()
            os.kill(os.getpid(), signal.SIGTERM)
            with pytest.raises(StopRequested) as err:
                check_stop()
            assert err.value.signum == signal.SIGTERM
            os.kill(os.getpid(), signal.SIGTERM)  # the second: the previous handler's
            assert seen == [signal.SIGTERM]
        check_stop()  # the flag ends with the block
        assert signal.getsignal(signal.SIGINT) is sigint
        codes = [RunStopped(s, Path("c"), Path("r")).exit_code for s in (signal.SIGTERM, signal.SIGINT)]
        assert codes == [143, 130]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_out_of_memory_is_recognized_and_named():
    """torch's OutOfMemoryError and a RuntimeError saying "out of memory" are out of memory;
    the message names the three settings with their values and the intact checkpoint."""
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: not enough memory: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    config = load_config("tiny")
    text = out_of_memory_message(torch.OutOfMemoryError("CUDA out of memory"), config, 4,
                                 Path("runs/tiny"), Path("runs/tiny/step_000004"))
    for part in ("step 5 of 20", "train.micro_batch_size (now 32", "rollout.batch_size (now 64)",
                 "rollout.max_new_tokens (now 8)", "runs/tiny/step_000004", "--resume runs/tiny"):
        assert part in text


def test_a_resumed_run_keeps_its_recipe(tmp_path):
    """Resuming with another loss or learning rate is refused, listing each difference;
    train.steps, micro-batch, checkpoint and log settings may change."""
    saved = load_config("tiny")
    changed = load_config("tiny", {"algo.loss": "grpo", "train.lr": 1e-5})
    with pytest.raises(ConfigError) as err:
        check_resumable(saved, changed, tmp_path / "step_000002")
    assert [p.path for p in err.value.problems] == ["algo.loss", "train.lr", ""]
    check_resumable(saved, load_config("tiny", {"train.steps": 40, "train.micro_batch_size": 16,
                                                "log.progress": True}), tmp_path)


def test_a_run_saved_on_another_device_resumes_here(tmp_path):
    """train.device may change at a resume (checkpoints are device-independent): a run saved
    on cuda:0 resumes with a recipe for this machine's CPU."""
    saved = load_config("tiny")
    saved = saved.model_copy(update={"train": saved.train.model_copy(update={"device": "cuda:0"})})
    check_resumable(saved, load_config("tiny"), tmp_path)


def test_a_recipe_without_an_optional_section_resumes(tmp_path):
    """The default recipe has no [compare] section (None in the config): its resume check
    compares it like any key instead of failing on it; a [compare] section added since is a
    difference."""
    saved = load_config("default")
    assert saved.compare is None
    check_resumable(saved, load_config("default", {"train.steps": 20}), tmp_path)
    with pytest.raises(ConfigError) as err:
        check_resumable(saved, load_config("tiny"), tmp_path)
    assert "compare.arms" in {p.path for p in err.value.problems}


def test_resume_config_reads_the_run_folder_wherever_it_is(tmp_path):
    """--resume RUN_DIR loads the resolved recipe saved there, placed in RUN_DIR (even when
    the folder was moved), and refuses overrides that would change the run; a run folder with
    no checkpoint yet (stopped in its warm start) starts its run from step 1, saying so."""
    original = load_config("tiny", {"run.output_dir": "elsewhere"})
    save_resolved(original, tmp_path / "moved")
    fresh = resume_config(tmp_path / "moved")
    assert (fresh.run.output_dir, fresh.run.name) == (str(tmp_path), "moved")
    assert fresh.algo == original.algo and fresh.run.resume
    model = torch.nn.Linear(2, 2)
    checkpoint.save(tmp_path / "moved", 1, model, [torch.optim.AdamW(model.parameters())],
                    {"bad_steps": 0}, checkpoint.capture_rng(), to_toml(original), keep=1)
    config = resume_config(tmp_path / "moved", ["--train.steps=30"])
    assert (config.run.output_dir, config.run.name) == (str(tmp_path), "moved")
    assert config.train.steps == 30 and config.run.resume
    assert config.algo == original.algo and config.quant == original.quant
    for bad in (["--algo.loss=grpo"], ["--run.name=other"]):
        with pytest.raises(ConfigError, match="cannot change when resuming"):
            resume_config(tmp_path / "moved", bad)
    with pytest.raises(ConfigError, match="not a run folder"):
        resume_config(tmp_path / "missing")
