"""Checkpoints are complete or ignored: whatever point a save is killed at, `latest` names a
checkpoint that loads, with the weights, optimizer state and RNG state of its step."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from qarl.train import checkpoint

REPO = Path(__file__).resolve().parents[3]


def _model_and_optimizer(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, [opt]


def _fill(model: nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)


def _save(run_dir, step, model, opts, keep=2):
    _fill(model, float(step))
    return checkpoint.save(run_dir, step, model, opts, {"bad_steps": 0}, checkpoint.capture_rng(),
                           f"# config of step {step}\n", keep=keep)


def _loaded_step(run_dir) -> int:
    """Load `latest` into a fresh model; check its weights are those of its step."""
    folder = checkpoint.latest(run_dir)
    model, opts = _model_and_optimizer(seed=1)
    state, _ = checkpoint.load(folder, model, opts)
    assert folder.name == f"step_{state['step']:06d}"
    assert all(torch.equal(p, torch.full_like(p, state["step"])) for p in model.parameters())
    return state["step"]


def test_round_trip_restores_weights_optimizer_rng_and_metrics(tmp_path):
    """What a checkpoint restores is bit-identical to what was saved: master weights, every
    optimizer tensor and scalar, the torch and Python RNG states, the trainer state; the run's
    metrics file comes back as it was at the save (a killed run's later, torn rows dropped)."""
    model, opts = _model_and_optimizer()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    torch.manual_seed(7)
    random.seed(7)
    rng = checkpoint.capture_rng()
    folder = checkpoint.save(tmp_path, 3, model, opts, {"bad_steps": 2}, rng, "x = 1\n", keep=2)
    expected = (torch.rand(4), random.random())
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')
    model2, opts2 = _model_and_optimizer(seed=3)
    state, restored = checkpoint.load(folder, model2, opts2)
    assert state["step"] == 3 and state["bad_steps"] == 2
    assert (folder / "config.toml").read_text() == "x = 1\n"
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    sa, sb = opts[0].state_dict(), opts2[0].state_dict()
    assert sa["param_groups"] == sb["param_groups"]
    for pid in sa["state"]:
        for key, value in sa["state"][pid].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb["state"][pid][key]))
    checkpoint.restore_rng(restored)
    assert torch.equal(torch.rand(4), expected[0]) and random.random() == expected[1]
    checkpoint.restore_metrics(folder, tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_latest_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    """A missing, garbled or dangling `latest` pointer falls back to the newest complete
    folder; folders missing a file and temporary folders are never chosen."""
    model, opts = _model_and_optimizer()
    for step in (1, 2):
        _save(tmp_path, step, model, opts)
    (tmp_path / "step_000009").mkdir()  # incomplete: no files
    (tmp_path / ".tmp_step_000010").mkdir()
    for pointer in (None, "garbage\n", "step_000007\n"):
        (tmp_path / "latest").unlink(missing_ok=True)
        if pointer:
            (tmp_path / "latest").write_text(pointer)
        assert checkpoint.latest(tmp_path).name == "step_000002"
    (tmp_path / "latest").write_text("step_000001\n")
    assert checkpoint.latest(tmp_path).name == "step_000001"
    assert checkpoint.latest(tmp_path / "nothing_here") is None


class _Killed(BaseException):
    pass


def test_a_save_killed_at_any_file_operation_leaves_a_loadable_latest(tmp_path, monkeypatch):
    """The save of step 3 (over steps 1 and 2, keep=2, so it also rotates) is cut short at
    its 1st, 2nd, ... file operation (write, fsync, rename, delete), as a kill would: after
    each, `latest` loads and names step 2 or 3 with that step's weights, and the next save
    succeeds from whatever was left behind."""
    real = {"save_file": checkpoint.save_file, "_fsync": checkpoint._fsync,
            "replace": os.replace, "rmtree": shutil.rmtree, "copyfile": shutil.copyfile}
    budget = [0]

    def counted(fn):
        def call(*args, **kwargs):
            budget[0] -= 1
            if budget[0] < 0:
                raise _Killed()
            return fn(*args, **kwargs)
        return call

    class Os:  # the module's `os`, with replace counted
        def __getattr__(self, name):
            return counted(real["replace"]) if name == "replace" else getattr(os, name)

    class Shutil:
        def __getattr__(self, name):
            return counted(real[name]) if name in real else getattr(shutil, name)

    model, opts = _model_and_optimizer()
    seen = set()
    for kill_at in range(200):
        run_dir = tmp_path / f"run{kill_at}"
        for step in (1, 2):
            _save(run_dir, step, model, opts)
        monkeypatch.setattr(checkpoint, "save_file", counted(real["save_file"]))
        monkeypatch.setattr(checkpoint, "_fsync", counted(real["_fsync"]))
        monkeypatch.setattr(checkpoint, "os", Os())
        monkeypatch.setattr(checkpoint, "shutil", Shutil())
        budget[0] = kill_at
        try:
            _save(run_dir, 3, model, opts)
            finished = True
        except _Killed:
            finished = False
        monkeypatch.undo()
        seen.add(_loaded_step(run_dir))
        _save(run_dir, 3, model, opts)
        assert _loaded_step(run_dir) == 3
        assert sorted(p.name for p in run_dir.glob("step_*")) == ["step_000002", "step_000003"]
        if finished:
            break
    assert finished and kill_at > 15 and seen == {2, 3}


SAVER = """
import sys, torch
from pathlib import Path
from qarl.train import checkpoint
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 4096), torch.nn.Linear(4096, 512))  # 2.1M params
opts = [torch.optim.AdamW(model.parameters())]
model(torch.randn(2, 8)).sum().backward()
opts[0].step()
for step in range(int(sys.argv[2]), 10**6):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    checkpoint.save(Path(sys.argv[1]), step, model, opts, {}, checkpoint.capture_rng(), "", keep=2)
"""


def test_sigkill_during_saves_never_leaves_a_bad_latest(tmp_path):
    """A process saving checkpoints back to back is killed with SIGKILL at random moments
    (three times, resuming the step count): `latest` always loads, and names a checkpoint
    whose weights are those of its step."""
    rng = random.Random(0)
    first = 1
    for _ in range(3):
        child = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path), str(first)],
                                 env={**os.environ, "PYTHONPATH": str(REPO)})
        deadline = time.monotonic() + 60
        while checkpoint.latest(tmp_path) is None or _pointer_step(tmp_path) < first:
            assert child.poll() is None and time.monotonic() < deadline, "the saver did not save"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
        child.send_signal(signal.SIGKILL)
        child.wait()
        folder = checkpoint.latest(tmp_path)
        state = json.loads((folder / "state.json").read_text())
        weights = checkpoint.load_file(folder / "model.safetensors")
        assert all(torch.equal(w, torch.full_like(w, state["step"])) for w in weights.values())
        first = state["step"] + 1


def _pointer_step(run_dir) -> int:
    return int(checkpoint.latest(run_dir).name.split("_")[1])


@pytest.mark.parametrize("keep", [1, 3])
def test_rotation_keeps_the_newest(tmp_path, keep):
    """keep=N leaves the N newest checkpoints, the one `latest` names among them."""
    model, opts = _model_and_optimizer()
    for step in range(1, 6):
        _save(tmp_path, step, model, opts, keep=keep)
    names = sorted(p.name for p in tmp_path.glob("step_*"))
    assert names == [f"step_{s:06d}" for s in range(6 - keep, 6)]
    assert (tmp_path / "latest").read_text().strip() == "step_000005"
    assert not list(tmp_path.glob(".tmp_*")) and not list(tmp_path.glob(".trash_*"))



def _damage(folder, how: str) -> None:
    if how == "missing":
        (folder / "rng.safetensors").unlink()
    elif how == "cut":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size - 7])
    elif how == "json":
        (folder / "state.json").write_text("{not json")
    else:
        (folder / "config.toml").write_text("[train\n")


@pytest.mark.parametrize("how, says", [("missing", "missing rng.safetensors"),
                                       ("cut", "is cut short"), ("json", "state.json"),
                                       ("toml", "config.toml does not parse")])
def test_find_names_a_damaged_checkpoint_and_falls_back(tmp_path, how, says):
    """`find` passes over a checkpoint that is not whole (a file missing, the weights cut
    short, a state.json or config.toml that does not parse) even when `latest` names it,
    returns the newest whole one and says why the other was passed over; `set_aside` moves it
    out of what saves clean up, so the next save leaves it in place."""
    model, opts = _model_and_optimizer()
    for step in (1, 2):
        _save(tmp_path, step, model, opts, keep=3)
    config = tmp_path / "step_000001" / "config.toml"
    config.write_text('[train]\nsteps = 2\n')  # a config.toml that parses, as qarl writes
    (tmp_path / "step_000002" / "config.toml").write_text('[train]\nsteps = 2\n')
    _damage(tmp_path / "step_000002", how)
    found, damaged = checkpoint.find(tmp_path)
    assert found == tmp_path / "step_000001"
    assert list(damaged) == [tmp_path / "step_000002"] and says in damaged[tmp_path / "step_000002"]
    kept = checkpoint.set_aside(tmp_path / "step_000002")
    _save(tmp_path, 2, model, opts, keep=1)
    assert kept.name == "damaged_step_000002" and kept.is_dir()
    assert checkpoint.find(tmp_path) == (tmp_path / "step_000002", {})


def test_a_whole_checkpoint_has_no_problem(tmp_path):
    """What `save` writes is whole for `problem`."""
    model, opts = _model_and_optimizer()
    folder = checkpoint.save(tmp_path, 3, model, opts, {"bad_steps": 0}, checkpoint.capture_rng(),
                             "[train]\nsteps = 3\n", keep=1)
    assert checkpoint.problem(folder) is None


def test_a_weights_only_checkpoint_is_whole_and_leaves_the_optimizer_alone(tmp_path):
    """optimizer_state=False (train.final_checkpoint = 'weights'): no optimizer file, a whole
    checkpoint for `problem` / `find` / the rotation, the weights and RNG restored bit for bit,
    the optimizers left as they were; a full checkpoint that lost its optimizer file is still
    damaged, never taken for a weights-only one."""
    model, opts = _model_and_optimizer()
    _save(tmp_path, 1, model, opts)
    _fill(model, 2.0)
    folder = checkpoint.save(tmp_path, 2, model, opts, {"bad_steps": 0}, checkpoint.capture_rng(),
                             "[train]\nsteps = 2\n", keep=2, optimizer_state=False)
    assert not (folder / "optimizer.safetensors").exists()
    assert checkpoint.problem(folder) is None and not checkpoint.has_optimizer_state(folder)
    assert checkpoint.find(tmp_path) == (folder, {})
    assert checkpoint.has_optimizer_state(tmp_path / "step_000001")
    model2, opts2 = _model_and_optimizer(seed=5)
    before = {k: v.clone() for k, v in opts2[0].state_dict()["state"][0].items()}
    state, _ = checkpoint.load(folder, model2, opts2)
    assert state["step"] == 2 and state["optimizer_state"] is False
    assert all(torch.equal(p, torch.full_like(p, 2.0)) for p in model2.parameters())
    after = opts2[0].state_dict()["state"][0]
    assert all(torch.equal(before[k], after[k]) for k in before)
    _save(tmp_path, 3, model, opts, keep=2)  # the rotation counts it as a whole checkpoint
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000002", "step_000003"]

    (tmp_path / "step_000003" / "optimizer.safetensors").unlink()
    found, damaged = checkpoint.find(tmp_path)
    assert found == folder
    assert "missing optimizer.safetensors" in damaged[tmp_path / "step_000003"]
