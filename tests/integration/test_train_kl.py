"""The tiny recipe with top-p sampling and a KL term to the reference policy: what the term
computes, that its reference survives a resume exactly, and that another one is refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from qarl.errors import UserError
from qarl.report import read_metrics
from qarl.train.checkpoint import latest
from qarl.train.trainer import train

KL = {"algo.kl_coef": 0.05, "algo.kl_estimator": "k3", "rollout.top_p": 0.9,
      "rollout.min_p": 0.01, "train.steps": 3, "train.checkpoint_every": 1, "eval.size": 8,
      "eval.full_precision": False, "log.plot": False, "log.progress": False}


def _run(folder, **extra) -> list[dict]:
    train("tiny", {"run.output_dir": str(folder), **KL, **extra})
    return [r for r in read_metrics(folder / "tiny" / "metrics.jsonl") if r["kind"] == "train"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """The 3-step run, uninterrupted."""
    folder = tmp_path_factory.mktemp("kl")
    return folder, _run(folder)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """The same run stopped after step 2 (its checkpoints kept): copy it before resuming."""
    folder = tmp_path_factory.mktemp("kl-stopped")
    _run(folder, **{"train.steps": 2})
    return folder


def test_the_kl_term_is_the_coefficient_times_the_token_mean_kl(whole):
    """Step 1 samples from the reference itself: KL 0. Later steps have a KL > 0, and with
    one optimizer step per update (whose logp value is old_logp) the loss's KL term is
    kl_coef x the step's token-mean k3 of old_logp against the reference. The replay stays
    bit for bit with truncated sampling."""
    _, rows = whole
    assert rows[0]["kl/token_mean"] == 0.0 and rows[0]["loss/kl_term"] == 0.0
    later = rows[1:]
    assert all(r["kl/token_mean"] > 0 for r in later)
    for r in later:
        assert r["loss/kl_term"] == pytest.approx(KL["algo.kl_coef"] * r["kl/token_mean"],
                                                  rel=1e-5)
        assert 0.0 < r["loss/kl_share"] <= 1.0
    assert all(r["mismatch/abs_diff_max"] == 0.0 for r in rows)
    assert all(r["time/ref_logp"] > 0 for r in rows)


def test_a_resumed_run_with_a_kl_term_equals_the_uninterrupted_one(whole, stopped, tmp_path):
    """Stopped after step 2 and resumed: the same final weights and the same KL metrics at
    step 3, the reference rebuilt from the warm start being the one the checkpoint names."""
    folder, rows = whole
    parts = tmp_path / "parts"
    shutil.copytree(stopped, parts)
    resumed = _run(parts)
    a = load_file(latest(folder / "tiny") / "model.safetensors")
    b = load_file(latest(parts / "tiny") / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for key in ("kl/token_mean", "loss/kl_term", "reward/mean"):
        assert resumed[2][key] == rows[2][key], key
    state = json.loads((latest(parts / "tiny") / "state.json").read_text())
    assert len(state["reference"]) == 64


def test_a_resume_against_another_reference_is_refused_and_changes_nothing(stopped, tmp_path):
    """A checkpoint whose state names another reference digest: the resume stops with a
    UserError naming the cause, before any step, and the checkpoint is left as it was."""
    parts = tmp_path / "other"
    shutil.copytree(stopped, parts)
    newest = latest(parts / "tiny")
    state_file = newest / "state.json"
    state = json.loads(state_file.read_text())
    state["reference"] = "0" * 64
    state_file.write_text(json.dumps(state))
    before = sorted(p.name for p in (parts / "tiny").iterdir())
    with pytest.raises(UserError, match="another reference policy"):
        _run(parts)
    assert latest(parts / "tiny") == newest
    assert sorted(p.name for p in (parts / "tiny").iterdir()) == before
