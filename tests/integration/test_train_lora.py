"""LoRA runs end to end on `tiny` (tiny.toml with [lora] rank 4): kernel alignment exact at
every step, adapters-only syncs and checkpoints, an exact resume, the exports (PEFT folder
that peft loads onto the exported base with qarl's logits, merged hf, compressed-tensors base),
a PEFT folder as the start of a run, and bad [lora] input refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qarl.cli import main
from qarl.config import ConfigError, load_config
from qarl.errors import UserError
from qarl.export import export_run
from qarl.export.run import load_master, read_run
from qarl.lora.layers import lora_layers
from qarl.report import read_metrics
from qarl.train.checkpoint import latest
from qarl.train.sft import warm_start
from qarl.train.trainer import train

LORA = {"lora.rank": 4, "train.steps": 3, "eval.size": 8, "eval.full_precision": False,
        "log.plot": False, "log.progress": False}


def _run(out: Path, **extra) -> Path:
    train("tiny", {"run.output_dir": str(out), **LORA, **extra})
    return out / "tiny"


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A 3-step LoRA run of tiny.toml, a checkpoint after every step."""
    return _run(tmp_path_factory.mktemp("lora"), **{"train.checkpoint_every": 1})


def test_kernel_alignment_stays_exact_and_syncs_carry_adapters_only(lora_run):
    """Every step: max |old_logp - rollout_logp| exactly 0 and the audit finds nothing; the
    pushes after the first send the adapters alone (their fp32 bytes), and the base's codes
    never change (sync/changed_code_frac 0)."""
    rows = [r for r in read_metrics(lora_run / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["mismatch/abs_diff_max"] for r in rows] == [0.0] * 3
    assert all(r["audit/failed"] == 0.0 for r in rows)
    config = load_config("tiny")
    adapters = load_file(latest(lora_run) / "model.safetensors")
    megabytes = sum(t.numel() * 4 for t in adapters.values()) / 2**20
    assert [r["sync/megabytes"] for r in rows] == pytest.approx([megabytes] * 3, rel=1e-9)
    assert all(r["sync/changed_code_frac"] == 0.0 for r in rows[1:])
    assert config.lora.rank == 0  # the recipe itself trains full weights


def test_checkpoints_hold_the_adapters_and_the_run_learns_in_them(lora_run):
    """model.safetensors holds `<layer>.lora_A` / `.lora_B` of every block projection and
    nothing else; B moved away from its zero init; the optimizer state is the adapters'."""
    weights = load_file(latest(lora_run) / "model.safetensors")
    assert weights and all(k.endswith((".lora_A", ".lora_B")) for k in weights)
    assert len(weights) == 2 * 7 * _blocks()
    assert any(float(t.abs().max()) > 0 for k, t in weights.items() if k.endswith("lora_B"))
    optimizer = load_file(latest(lora_run) / "optimizer.safetensors")
    # AdamW: exp_avg and exp_avg_sq of every adapter tensor, and its step count
    assert sum(t.numel() for t in optimizer.values()) == (
        2 * sum(t.numel() for t in weights.values()) + len(weights))


def _blocks() -> int:
    from qarl.model import load_model

    return len(load_model("tiny").model.layers)


def test_a_killed_lora_run_resumes_to_the_same_adapters(lora_run, tmp_path):
    """Stopped after step 2 and resumed, the run ends with exactly the adapters (and
    optimizer state) of the uninterrupted run."""
    parts = _run(tmp_path, **{"train.checkpoint_every": 1, "train.steps": 2})
    _run(tmp_path, **{"train.checkpoint_every": 1})
    for name in ("model.safetensors", "optimizer.safetensors"):
        a, b = load_file(latest(lora_run) / name), load_file(latest(parts) / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_peft_folder_loads_in_peft_with_qarls_logits(lora_run, tmp_path):
    """`qarl export --format peft` + the base as hf (`--base-only`): transformers + peft give
    the logits of qarl's full-precision LoRA model to fp32 rounding (PEFT computes base(x) +
    B(A(x)) * scale, qarl's order; the GEMMs differ: qarl.native's packed one vs torch's),
    and so does the merged hf folder (W + scale B A summed first). Measured max |d| on logits
    of ~10: 2.6e-6 (peft), 3.3e-6 (merged); tolerance 1e-4."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert main(["export", str(lora_run), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    assert main(["export", str(lora_run), str(tmp_path / "base"), "--format", "hf",
                 "--base-only"]) == 0
    assert main(["export", str(lora_run), str(tmp_path / "merged"), "--format", "hf"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    ours = load_master(read_run(lora_run), warm_start(load_config("tiny"))).eval()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(tmp_path / "base").encode("3 + 4 = 7. 5 + 2 =")])
    with torch.no_grad():
        a, b, c = ours.logits(ids), theirs(ids).logits, merged(ids).logits
    assert torch.allclose(a, b, rtol=0, atol=1e-4)
    assert torch.allclose(a, c, rtol=0, atol=1e-4)
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)(ids).logits
    assert float((a - plain).abs().max()) > 1e-2  # the adapter acts (peft wrapped `base` in place)


def test_compressed_tensors_export_of_a_lora_run_is_its_base(lora_run, tmp_path):
    """compressed-tensors of a LoRA run holds the frozen base's codes (what the engine served
    the adapters on): the same folder as the warm-started base model's own export would be."""
    from qarl.export import read_ct
    from qarl.quant import QWeight, export_state, quantize_model

    out = export_run(lora_run, tmp_path / "ct", "compressed-tensors",
                     base=warm_start(load_config("tiny")))
    expected = export_state(quantize_model(warm_start(load_config("tiny")), "w8a8-int8"))
    got = read_ct(out)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, QWeight):
            assert torch.equal(got[name].codes, value.codes), name
        else:
            assert torch.equal(got[name], value), name


def test_a_peft_folder_starts_a_run(lora_run, tmp_path):
    """lora.init_from: the new run's learner starts from the folder's adapters (its step 0
    policy is the exported one): after 0 steps of training its checkpoint equals them."""
    folder = export_run(lora_run, tmp_path / "adapter", "peft")
    out = _run(tmp_path / "runs", **{"lora.init_from": str(folder), "train.steps": 1,
                                     "train.lr": 0.0})
    start = load_file(latest(out) / "model.safetensors")
    trained = load_file(latest(lora_run) / "model.safetensors")
    assert start.keys() == trained.keys()
    assert all(torch.equal(start[k], trained[k]) for k in start)


def test_full_fine_tuning_is_refused_as_a_peft_source(tmp_path):
    with pytest.raises(UserError, match="full fine-tuning run.*--format hf"):
        out = tmp_path / "full"
        train("tiny", {"run.output_dir": str(out), **{**LORA, "lora.rank": 0, "train.steps": 1}})
        export_run(out / "tiny", tmp_path / "x", "peft")


@pytest.mark.parametrize("override,where,match", [
    ({"lora.include": ["no_such_layer"]}, "lora.include", "matches no linear layer"),
    ({"lora.rank": 1000}, "lora.rank", "larger than"),
    ({"rollout.engine": "vllm"}, "lora.rank", "rollout.engine = 'local'"),
])
def test_bad_lora_input_is_refused_before_any_work(tmp_path, override, where, match):
    """A target pattern that matches nothing, a rank wider than a layer, an engine that takes
    no adapters: the recipe fails to load, naming the key, and no run folder is written."""
    with pytest.raises(ConfigError) as err:
        train("tiny", {"run.output_dir": str(tmp_path), **LORA, **override})
    assert any(p.path == where and match in p.message for p in err.value.problems), err.value
    assert not (tmp_path / "tiny").exists()


def test_an_adapter_of_another_base_is_refused_before_any_work(lora_run, tmp_path):
    """An adapter folder whose tensors do not fit the model (here: made for a wider layer), or
    of another rank, or not a LoRA folder at all: a ConfigError naming lora.init_from."""
    folder = export_run(lora_run, tmp_path / "adapter", "peft")
    config = json.loads((folder / "adapter_config.json").read_text())
    cases = {}
    wrong_rank = tmp_path / "rank"
    wrong_rank.mkdir()
    (wrong_rank / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    (wrong_rank / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes())
    cases[wrong_rank] = "rank 8"
    from safetensors.torch import save_file

    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file({k: torch.zeros(t.shape[0], t.shape[1] + 8) if "lora_A" in k else t
               for k, t in tensors.items()}, wide / "adapter_model.safetensors")
    cases[wide] = "another base model"
    cases[tmp_path / "nothing"] = "has no adapter_config.json"
    for path, match in cases.items():
        with pytest.raises(ConfigError) as err:
            train("tiny", {"run.output_dir": str(tmp_path / "runs"), **LORA,
                           "lora.init_from": str(path)})
        assert any(p.path == "lora.init_from" and match in p.message for p in err.value.problems), (
            path, err.value)
    assert not (tmp_path / "runs").exists()


def test_lora_layers_of_the_export_match_the_run(lora_run):
    """load_master of a LoRA checkpoint has the run's adapters (rank, scale, every target)."""
    model = load_master(read_run(lora_run), warm_start(load_config("tiny")))
    layers = lora_layers(model)
    assert {layer.rank for layer in layers.values()} == {4}
    assert {layer.scaling for layer in layers.values()} == {2.0}
    assert len(layers) == 7 * _blocks()


def test_qarl_eval_of_a_lora_checkpoint_is_the_runs_final_eval(lora_run, capsys, tmp_path):
    """`qarl eval --checkpoint` of a LoRA run's last checkpoint (the recipe with its [lora])
    puts the adapters on the recipe's base and reproduces the run's own final evaluation of
    the deployed policy exactly."""
    final = [r for r in read_metrics(lora_run / "metrics.jsonl") if r["kind"] == "eval"][-1]
    args = [f"--{k}={json.dumps(v)}" for k, v in LORA.items() if k != "train.steps"]
    assert main(["eval", "tiny", "--checkpoint", str(latest(lora_run)), "--json",
                 f"--run.output_dir={tmp_path}", *args]) == 0
    out = capsys.readouterr().out
    metrics = json.loads(out[out.index("{\n"):])
    assert metrics["eval/accuracy_quantized"] == final["eval/accuracy_quantized"]
