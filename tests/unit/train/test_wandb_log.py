"""log.wandb: metrics rows go to a Weights & Biases run (offline: local files only) named by
qarl's metric keys at qarl's steps, with the resolved recipe as its config."""

from __future__ import annotations

from pathlib import Path

import pytest

from qarl.config import ConfigError, load_config
from qarl.train.metrics import MetricsLogger, start_wandb

wandb = pytest.importorskip("wandb")

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of framed records
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def wandb_records(path: Path):
    """The protobuf records (wandb's own `Record` message) of an offline run's .wandb file."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, payload = 7, b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        payload = chunk if kind in (FULL, FIRST) else payload + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(payload)
            yield record


def history(run_folder: Path) -> dict[int, dict[str, float]]:
    """step -> {metric key: value} of the one offline run under `run_folder`."""
    import json

    (file,) = run_folder.glob("wandb/offline-run-*/run-*.wandb")
    out: dict[int, dict[str, float]] = {}
    for record in wandb_records(file):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                     for item in record.history.item}
            out.setdefault(int(items.pop("_step")), {}).update(
                {k: v for k, v in items.items() if not k.startswith("_")})
    return out


def config_of(run_folder: Path) -> dict:
    import json

    (file,) = run_folder.glob("wandb/offline-run-*/run-*.wandb")
    config = {}
    for record in wandb_records(file):
        if record.WhichOneof("record_type") in ("run", "config"):
            items = record.run.config.update if record.HasField("run") else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in items})
    return config


@pytest.fixture
def offline(tmp_path, monkeypatch):
    folder = tmp_path / "wandb_dir"
    folder.mkdir()
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(folder), "WANDB_SILENT": "true",
                       "WANDB_DISABLE_CODE": "true"}.items():
        monkeypatch.setenv(key, value)
    return folder


def test_rows_reach_the_offline_run_files(tmp_path, offline):
    """Every numeric metric of every row is in the run's .wandb file at its step under its
    qarl key, eval rows beside train rows; None and strings are left out; the config is the
    recipe given."""
    run = start_wandb(tmp_path, "r", "qarl", {"train": {"lr": 1e-4}, "task": {"name": "gcd"}})
    log = MetricsLogger(tmp_path, 2, progress=False, tensorboard=False, wandb_run=run)
    log.log(0, {"eval/accuracy_quantized": 0.25}, kind="eval")
    log.log(1, {"reward/mean": 0.5, "loss/clip_frac": 0.125, "mismatch/k3_kl": None})
    log.log(2, {"reward/mean": 0.75, "loss/clip_frac": 0.0})
    log.log(2, {"eval/accuracy_quantized": 0.5}, kind="eval")
    log.close()
    assert history(offline) == {0: {"eval/accuracy_quantized": 0.25},
                                1: {"reward/mean": 0.5, "loss/clip_frac": 0.125},
                                2: {"reward/mean": 0.75, "loss/clip_frac": 0.0,
                                    "eval/accuracy_quantized": 0.5}}
    config = config_of(offline)
    assert config["train"] == {"lr": 1e-4} and config["task"] == {"name": "gcd"}
    assert (tmp_path / "wandb_id.txt").read_text().strip() in str(next(offline.glob("wandb/off*")))


def test_missing_package_refused_at_load(monkeypatch):
    """log.wandb = true without wandb installed is refused, naming the extra."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError) as caught:
        load_config("tiny", {"log.wandb": True})
    assert "log.wandb" in str(caught.value) and "qarl[wandb]" in str(caught.value)


def test_a_tiny_run_logs_its_metrics_rows_to_wandb(tmp_path, offline):
    """`qarl train tiny` with log.wandb = true (offline): the wandb run holds every numeric
    figure of metrics.jsonl, train and eval rows, at the same step under the same key, and its
    config is the resolved recipe."""
    from qarl.report import read_metrics
    from qarl.train.trainer import train

    train("tiny", {"run.output_dir": str(tmp_path), "log.wandb": True, "train.steps": 2,
                   "rollout.batch_size": 16, "train.micro_batch_size": 16, "eval.size": 8,
                   "eval.full_precision": False, "sft.steps": 2})
    rows = read_metrics(tmp_path / "tiny" / "metrics.jsonl")
    expected: dict[int, dict[str, float]] = {}
    for row in rows:
        expected.setdefault(row["step"], {}).update(
            {k: v for k, v in row.items() if k not in ("step", "kind")
             and isinstance(v, int | float) and not isinstance(v, bool)})
    logged = history(offline)
    assert sorted(logged) == sorted(expected) == [0, 1, 2]
    for step, figures in expected.items():
        assert logged[step] == pytest.approx(figures, rel=1e-12), step
    config = config_of(offline)
    assert config["run"]["name"] == "tiny" and config["train"]["steps"] == 2
    assert config["log"]["wandb"] is True
