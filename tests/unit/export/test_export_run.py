"""`qarl export` / `export_run` on a real 1-step tiny run: the hf folder loads in transformers
with qarl's logits, the compressed-tensors folder holds exactly the codes the run's engine
computes, run and checkpoint folders both work, and refusals say why and what to do."""

from __future__ import annotations

import json
import re

import pytest
import torch

from qarl.cli import main
from qarl.errors import UserError
from qarl.export import export_run, read_ct
from qarl.export.run import load_master, read_run
from qarl.quant import QWeight, export_state, quantize_model

RUN_ARGS = ["--train.steps=1", "--sft.steps=0", "--rollout.batch_size=4", "--rollout.group_size=2",
            "--train.micro_batch_size=4", "--task.eval_size=4", "--eval.full_precision=false",
            "--log.plot=false", "--log.progress=false"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished 1-step `qarl train tiny` run (w8a8-int8), its folder."""
    out = tmp_path_factory.mktemp("runs")
    assert main(["train", "tiny", f"--run.output_dir={out}", *RUN_ARGS]) == 0
    return out / "tiny"


def test_run_and_checkpoint_folders_name_the_same_policy(run_dir):
    """A run folder resolves to the checkpoint its `latest` names; the checkpoint folder to
    itself; the recipe keys come from the config the steps were taken with."""
    from_run, from_ckpt = read_run(run_dir), read_run(run_dir / "step_000001")
    assert from_run == from_ckpt
    assert (from_run.checkpoint.name, from_run.model_name, from_run.scheme) == (
        "step_000001", "tiny", "w8a8-int8")


def test_hf_export_loads_in_transformers_with_qarls_logits(run_dir, tmp_path):
    """transformers' AutoModelForCausalLM on the hf folder gives exactly the logits of qarl's
    model on the checkpoint's master weights (fp32, torch.equal: measured identical)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = export_run(run_dir, tmp_path / "hf", "hf")
    ours = load_master(read_run(run_dir))
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(out).encode("What is 3 + 4? Answer:")])
    with torch.no_grad():
        a, b = ours.logits(ids), theirs(ids).logits
    assert torch.equal(a, b)


def test_compressed_tensors_export_holds_the_engines_codes(run_dir, tmp_path):
    """read_ct of the exported folder equals export_state of the checkpoint's weights
    quantized as the run's engine is (kernel mode, default layers): every QWeight and tensor
    bit for bit; config.json carries the quantization_config and the tokenizer is there."""
    out = export_run(run_dir, tmp_path / "ct", "compressed-tensors")
    expected = export_state(quantize_model(load_master(read_run(run_dir)), "w8a8-int8", mode="kernel"))
    got = read_ct(out)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, QWeight):
            assert torch.equal(got[name].codes, value.codes) and torch.equal(got[name].scales, value.scales)
            assert (got[name].scheme, got[name].shape) == (value.scheme, value.shape)
        else:
            assert torch.equal(got[name], value), name
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["tie_word_embeddings"] is True and (out / "tokenizer.json").is_file()


def test_scheme_override_and_the_cli(run_dir, tmp_path, capsys):
    """`qarl export ... --scheme w4a16-int4` writes pack-quantized int4 from the same weights."""
    out = tmp_path / "int4"
    assert main(["export", str(run_dir), str(out), "--format", "compressed-tensors",
                 "--scheme", "w4a16-int4"]) == 0
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [g["format"] for g in groups.values()] == ["pack-quantized"]
    assert "wrote compressed-tensors folder" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--scheme", "none"], "full precision.*use --format hf"),
    (["--scheme", "w9"], "unknown scheme 'w9'; valid: "),
    (["--format", "peft", "--scheme", "w4a16-int4"], "--scheme applies to --format "
                                                     "compressed-tensors.*drop --scheme"),
    (["--base-only"], "--base-only applies to --format hf.*drop --base-only"),
    (["--format", "hf", "--base-only"], "full fine-tuning run.*no base apart from adapters to "
                                        "write; drop --base-only"),
])
def test_refusals_say_why_and_what_to_do(run_dir, tmp_path, capsys, args, message):
    """Schemes compressed-tensors cannot hold, and options the format or run has no use for
    (--scheme beside peft, --base-only beside another format or of a full fine-tuning run),
    exit 2 with the reason and the alternative, before any file is written."""
    out = tmp_path / "refused"
    args = args if "--format" in args else ["--format", "compressed-tensors", *args]
    assert main(["export", str(run_dir), str(out), *args]) == 2
    assert re.search(message, capsys.readouterr().err)
    assert not out.exists()


def test_asymmetric_int4_is_refused_before_writing(run_dir, tmp_path, monkeypatch):
    """A run trained with asymmetric int4 (float zero points) cannot be exported as
    compressed-tensors: the error names symmetric=true and --format hf; nothing is written."""
    from qarl.export import run as export_module

    asym = export_module.RunPolicy(**{**read_run(run_dir).__dict__, "scheme": "w4a16-int4",
                                      "options": {"symmetric": False}})
    monkeypatch.setattr(export_module, "read_run", lambda src: asym)
    with pytest.raises(ValueError, match="integer zero points.*symmetric = true.*--format hf"):
        export_run(run_dir, tmp_path / "asym", "compressed-tensors")
    assert not (tmp_path / "asym").exists()


def test_bad_sources_and_targets_are_refused(run_dir, tmp_path):
    """A folder that is neither a run nor a checkpoint, and a non-empty target, are refused."""
    with pytest.raises(UserError, match="neither a checkpoint folder"):
        export_run(tmp_path, tmp_path / "x", "hf")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "f").write_text("")
    with pytest.raises(UserError, match="not empty"):
        export_run(run_dir, tmp_path / "full", "hf")
