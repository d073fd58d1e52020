"""The quantization contract and the monitors in a run (`tiny`, in process), each against a
planted fault: altered scales are caught by the sync's digests at the step they happen, with
the layer named; a layer full precision on the engine stops the run before step 1; codes in
another group size are refused at the sync; with the digests off, a stale engine (fake
alignment) or altered codes (kernel alignment) go over the run's mismatch budget, flagged or
stopping the run before its update; a planted length collapse with a falling reward stops a
run early with its checkpoint saved."""

from __future__ import annotations

import copy
import json

import pytest

from qarl.quant import quant_layers
from qarl.rollout import LocalEngine
from qarl.train import policy as setup, trainer
from qarl.train.guards import TrainingAborted
from qarl.train.trainer import train

LAYER = "model.layers.1.mlp.down_proj"
ENGINE_LOAD = LocalEngine.load_weights
SMALL = {"train.steps": 3, "rollout.batch_size": 8, "train.micro_batch_size": 8,
         "eval.size": 8, "eval.every": 0, "eval.full_precision": False, "log.plot": False,
         "sft.steps": 4}


def _overrides(tmp_path, **extra) -> dict:
    return {**SMALL, "run.output_dir": str(tmp_path), **extra}


def _rows(run_dir, kind="train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind", "train") == kind]


def test_scales_altered_in_a_sync_stop_the_run_at_that_step(tmp_path, monkeypatch):
    """The engine's install alters one layer's scales from the second push on (the push that
    ends step 1): the run stops in step 1, naming the layer and the part, before the engine
    samples step 2 with them; step 1's metrics are never logged."""
    install = LocalEngine.load_weights
    pushes = []

    def altering(self, state):
        install(self, state)
        pushes.append(1)
        if len(pushes) >= 2:
            layer = quant_layers(self.model)[LAYER]
            layer._qweight = copy.copy(layer._qweight)
            layer._qweight.scales = layer._qweight.scales * 1.5

    monkeypatch.setattr(LocalEngine, "load_weights", altering)
    with pytest.raises(TrainingAborted, match=rf"step 1: after the weight sync the engine .*"
                                              rf"{LAYER.replace('.', '[.]')} \(scales\)"):
        train("tiny", _overrides(tmp_path))
    assert _rows(tmp_path / "tiny") == []


def test_a_layer_full_precision_on_the_engine_stops_before_step_1(tmp_path, monkeypatch):
    """The engine's copy leaves one projection full precision (an ignore rule matching too
    much) under a naive learner, whose full-precision push it still takes: the run stops
    before step 1 naming it, and contract.json shows the row; with the layer in
    quant.contract_exempt the run goes on and lists it as exempt."""
    engine_copy = setup.engine_copy

    def leaky(model, quant, codes_only=False, lora=None):
        return engine_copy(model, quant.model_copy(update={"exclude": [LAYER]}), codes_only, lora)

    monkeypatch.setattr(setup, "engine_copy", leaky)
    monkeypatch.setattr(setup, "pushes_codes", lambda config: False)  # full weights reach it
    layer = LAYER.replace(".", "[.]")
    with pytest.raises(TrainingAborted, match=rf"before step 1: 1 linear layer.*{layer}: "
                                              r"learner full precision \(naive; the engine "
                                              r"quantizes it as w8a8-int8\), engine full "
                                              r"precision"):
        train("tiny", _overrides(tmp_path, **{"quant.align": "naive"}))
    rows = json.loads((tmp_path / "tiny" / "contract.json").read_text())["layers"]
    assert [r["layer"] for r in rows if r["status"] == "mismatch"] == [LAYER]
    assert not (tmp_path / "tiny" / "latest").exists()
    train("tiny", _overrides(tmp_path, **{"quant.align": "naive", "train.steps": 1,
                                          "quant.contract_exempt": [LAYER],
                                          "run.resume": False}))
    rows = json.loads((tmp_path / "tiny" / "contract.json").read_text())["layers"]
    assert [r["layer"] for r in rows if r["status"] == "exempt"] == [LAYER]


def _stale_engine(monkeypatch):
    """The engine takes each push one push late: from step 2 on it samples with the weights
    of the step before the learner's."""
    install = ENGINE_LOAD  # the real one, also where a test planted a lag before
    held = []

    def late(self, state, partial=False):
        held.append(state)
        install(self, held[-2] if len(held) > 1 else state, partial)

    monkeypatch.setattr(LocalEngine, "load_weights", late)


def test_a_stale_engine_goes_over_the_calibrated_budget(tmp_path, monkeypatch, capsys):
    """fake alignment, the digests off, the engine one weight version behind from step 2: the
    run's budget (budget_factor x step 1's mismatch, when the engine held the learner's own
    starting weights) flags the steps the engine lags at, one log line per episode naming the
    metric and how many times step 1's it is; the same run with the engine in step flags
    nothing. With quant.over_budget = 'stop' the run ends at the first such step, before its
    update, the checkpoint of the step before intact."""
    fake = {"quant.align": "fake", "quant.sync_check": False, "train.steps": 4,
            "rollout.batch_size": 64, "train.micro_batch_size": 32, "train.checkpoint_every": 1}
    train("tiny", _overrides(tmp_path, **fake, **{"run.name": "in-step"}))
    assert [r["contract/over_budget"] for r in _rows(tmp_path / "in-step")] == [0.0] * 4
    _stale_engine(monkeypatch)
    capsys.readouterr()
    train("tiny", _overrides(tmp_path, **fake, **{"run.name": "stale"}))
    rows = _rows(tmp_path / "stale")
    flags = [r["contract/over_budget"] for r in rows]
    assert flags[0] == 0.0 and 1.0 in flags  # step 1 calibrates; a lagging step is over
    budget = 4 * rows[0]["mismatch/abs_diff_mean"]
    for row, flag in zip(rows[1:], flags[1:]):
        assert row["contract/budget"] == pytest.approx(budget)
        assert flag == float(row["mismatch/abs_diff_mean"] > budget)
    episodes = sum(1 for before, now in zip([0.0] + flags, flags) if now > before)
    err = capsys.readouterr().err
    assert err.count("over the mismatch budget: mismatch/abs_diff_mean = ") == episodes
    first = flags.index(1.0) + 1
    _stale_engine(monkeypatch)  # a new engine, in step at its first push
    with pytest.raises(TrainingAborted, match=rf"step {first}: mismatch/abs_diff_mean = .* x "
                                              r"the .* of the run's first step.*"
                                              r"quant.over_budget"):
        train("tiny", _overrides(tmp_path, **fake, **{"run.name": "stopped",
                                                      "quant.over_budget": "stop"}))
    assert (tmp_path / "stopped" / f"step_{first - 1:06d}").is_dir()
    assert not (tmp_path / "stopped" / f"step_{first:06d}").exists()


def test_altered_codes_go_over_the_exact_budget_without_the_digests(tmp_path, monkeypatch):
    """kernel alignment, the digests off, one layer's scales altered by the engine's install
    from the second push on: old_logp is no longer the sampler's, and the exact budget (0 on
    the largest difference) flags step 2 and every step after."""
    install = LocalEngine.load_weights
    pushes = []

    def altering(self, state, partial=False):
        install(self, state, partial)
        pushes.append(1)
        if len(pushes) >= 2:
            layer = quant_layers(self.model)[LAYER]
            layer._qweight = copy.copy(layer._qweight)
            layer._qweight.scales = layer._qweight.scales * 1.5

    monkeypatch.setattr(LocalEngine, "load_weights", altering)
    train("tiny", _overrides(tmp_path, **{"quant.sync_check": False,
                                          "train.audit_fraction": 1.0}))
    rows = _rows(tmp_path / "tiny")
    assert [r["contract/over_budget"] for r in rows] == [0.0, 1.0, 1.0]
    assert rows[1]["mismatch/abs_diff_max"] > 0 and rows[1]["contract/budget"] == 0.0


def test_codes_of_another_group_size_are_refused_at_the_sync(tmp_path, monkeypatch):
    """After step 1 one learner layer starts quantizing in groups of 128 where the engine's
    layer decodes groups of 64 (w4a16-int4): the push that ends step 1 is refused before the
    engine takes it, naming the layer and both settings."""
    from qarl.quant.schemes import make_scheme
    from qarl.train.learner import update

    step = update.update_policy
    regrouped = []

    def regrouping(passes, *args):
        metrics = step(passes, *args)
        if not regrouped:
            layer = quant_layers(passes.model)[LAYER]
            layer.scheme = make_scheme(layer.scheme, group_size=128)
            layer.forget()
            regrouped.append(LAYER)
        return metrics

    monkeypatch.setattr("qarl.train.learner.learner.update_policy", regrouping)
    layer = LAYER.replace(".", "[.]")
    with pytest.raises(TrainingAborted, match=rf"step 1: the learner's quantizer settings differ"
                                              rf".*{layer}: learner w4a16-int4 g128 sym.*engine "
                                              r"w4a16-int4 g64 sym"):
        train("tiny", _overrides(tmp_path, **{"quant.scheme": "w4a16-int4"}))
    assert regrouped == [LAYER]


def test_a_length_collapse_stops_the_run_early_with_its_checkpoint(tmp_path, monkeypatch):
    """Responses planted to shrink to a fifth, and the reward from 1 to 0, from step 3 on: with
    window 2 the length monitor fires at step 4 (ratio (0.2 + 0.2) / 2 / 1 < 0.5, the reward
    fell); with monitor.early_stop the run ends there: step 4's checkpoint saved, the final
    eval run, summary.json names the alert; the monitor's history is in the checkpoint."""
    rl_step = trainer.rl_step

    def collapsing(policy, data, config, step):
        metrics = rl_step(policy, data, config, step)
        metrics["reward/mean"] = 1.0 if step < 2 else 0.0  # and worse answers: a collapse
        if step >= 2:
            metrics["response/length_mean"] = 0.2 * metrics["response/length_mean"]
        return metrics

    monkeypatch.setattr(trainer, "rl_step", collapsing)
    lengths = []
    real = trainer.Monitors.update

    def spy(self, metrics):  # the unplanted lengths, to compute the expected ratio
        lengths.append(metrics["response/length_mean"])
        return real(self, metrics)

    monkeypatch.setattr(trainer.Monitors, "update", spy)
    summary = train("tiny", _overrides(tmp_path, **{"train.steps": 8, "monitor.window": 2,
                                                    "monitor.early_stop": True}))
    run = tmp_path / "tiny"
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "monitor/length_ratio" not in rows[2]
    expected = (lengths[2] + lengths[3]) / (lengths[0] + lengths[1])
    assert rows[3]["monitor/length_ratio"] == pytest.approx(expected, rel=1e-12)
    assert rows[3]["monitor/alert"] == 1.0
    assert summary["early_stop"].startswith("step 4: length collapse")
    assert (run / "step_000004").is_dir() and len(_rows(run, "eval")) == 2
    state = json.loads((run / "step_000004" / "state.json").read_text())
    assert state["monitor"]["steps"] == 4
    assert state["monitor"]["history"]["response/length_mean"] == lengths
