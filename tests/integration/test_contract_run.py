"""The quantization contract and the monitors in a run (`tiny`, in process): planted drift is
caught at the step it happens with the layer named, a planted over-budget step is flagged (or
stops the run before its update), and a planted length collapse stops a run early with its
checkpoint saved."""

from __future__ import annotations

import copy
import json

import pytest

from qarl.quant import quant_layers
from qarl.train.budgets import Budget
from qarl.rollout import LocalEngine
from qarl.train import policy as setup, trainer
from qarl.train.guards import TrainingAborted
from qarl.train.trainer import train

LAYER = "model.layers.1.mlp.down_proj"
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


def _tight_budget(monkeypatch):
    tight = Budget("w4a16-int4 fake (local engine)", "mismatch/abs_diff_mean", 1e-9, "planted")
    monkeypatch.setattr("qarl.train.budgets.mismatch_budget", lambda *a, **k: tight)


def test_an_over_budget_step_is_flagged_and_can_stop_the_run(tmp_path, monkeypatch, capsys):
    """A budget far below `fake` int4's mismatch: every step is flagged (contract/over_budget
    = 1, the limit logged, one log line naming the budget); the shipped budget flags none.
    With quant.over_budget = 'stop' the run ends in step 1 before its update: no checkpoint."""
    fake = {"quant.scheme": "w4a16-int4", "quant.align": "fake", "train.steps": 2}
    train("tiny", _overrides(tmp_path, **fake, **{"run.name": "shipped"}))
    assert [r["contract/over_budget"] for r in _rows(tmp_path / "shipped")] == [0.0, 0.0]
    _tight_budget(monkeypatch)
    train("tiny", _overrides(tmp_path, **fake, **{"run.name": "flagged"}))
    rows = _rows(tmp_path / "flagged")
    assert [r["contract/over_budget"] for r in rows] == [1.0, 1.0]
    assert rows[0]["contract/budget"] == 1e-9
    assert "exceeds the w4a16-int4 fake (local engine) budget of 1e-09" in capsys.readouterr().err
    with pytest.raises(TrainingAborted, match="step 1: mismatch/abs_diff_mean = .* exceeds"
                                              ".*quant.over_budget = 'stop'"):
        train("tiny", _overrides(tmp_path, **fake, **{"run.name": "stopped",
                                                      "quant.over_budget": "stop"}))
    assert not (tmp_path / "stopped" / "latest").exists()


def test_a_length_collapse_stops_the_run_early_with_its_checkpoint(tmp_path, monkeypatch):
    """Responses planted to shrink to a fifth from step 3 on: with window 2 the length monitor
    fires at step 4 (ratio (0.2 + 0.2) / 2 / 1 < 0.5); with monitor.early_stop the run ends
    there: step 4's checkpoint saved, the final eval run, summary.json names the alert; the
    monitor's history is in the checkpoint."""
    rl_step = trainer.rl_step

    def collapsing(policy, data, config, step):
        metrics = rl_step(policy, data, config, step)
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
