"""PEFT LoRA folders (qarl/lora/peft.py): what is written, read back exactly (Mixtral experts
under their on-disk names), and every folder qarl cannot run refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from qarl.errors import UserError
from qarl.lora.peft import (
    config_problems, fit_problems, import_peft, read_config, target_modules, write_peft,
)
from qarl.model import CausalLM, ModelConfig
from qarl.quant import quantize_model
from qarl.lora.layers import adapter_state, attach_lora


def _model(family: str = "qwen3", **extra) -> CausalLM:
    torch.manual_seed(0)
    fields = dict(family=family, vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=False,
                  max_position_embeddings=64)
    return CausalLM(ModelConfig(**{**fields, **extra})).eval()


MIXTRAL = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)


def _trained(model, rank: int = 4, **lora) -> CausalLM:
    attach_lora(model, rank=rank, alpha=2.0 * rank, **lora)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for t in adapter_state(model).values():
            t.copy_(torch.randn(t.shape, generator=g))
    return model


def test_target_modules_are_leaf_names_when_they_select_exactly():
    linears = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
               "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    assert target_modules(linears[::2], linears) == ["q_proj"]
    assert target_modules(linears[:1], linears) == ["model.layers.0.self_attn.q_proj"]


@pytest.mark.parametrize("family,extra", [("qwen3", {}), ("mixtral", MIXTRAL)])
def test_a_written_folder_reads_back_exactly(tmp_path, family, extra):
    """write_peft then import_peft into a fresh model with the same targets: every adapter
    tensor equal; the file's names are PEFT's (base_model.model.<on-disk module>.lora_X.weight:
    Mixtral experts as block_sparse_moe.experts.E.w1/w2/w3)."""
    source = _trained(quantize_model(_model(family, **extra), "w8a8-int8", mode="kernel"))
    out = write_peft(source, tmp_path / "adapter", "some-base", source.config.family)
    config = read_config(out)
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")
    keys = load_file(out / "adapter_model.safetensors").keys()
    assert all(k.startswith("base_model.model.model.layers.") for k in keys)
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in keys)
    if family == "mixtral":
        assert any(".block_sparse_moe.experts.0.w1.lora_A.weight" in k for k in keys)
        assert not any(".mlp.experts." in k for k in keys)
    target = _model(family, **extra)
    attach_lora(target, rank=4, alpha=8.0)
    assert fit_problems(out, family, target) == []
    import_peft(target, out, family)
    want, got = adapter_state(source), adapter_state(target)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_adapters_that_do_not_fit_are_refused_before_anything_is_copied(tmp_path):
    """Fewer targets than the adapter has, another width, another rank or alpha: each a
    problem naming the fix; the model's adapters stay as they were."""
    out = write_peft(_trained(_model()), tmp_path / "adapter", "base", "qwen3")
    fewer = _model()
    attach_lora(fewer, rank=4, alpha=8.0, include=["q_proj"])
    assert "lora.include / exclude leave out" in " ".join(fit_problems(out, "qwen3", fewer))
    wider = _model(hidden_size=64, intermediate_size=64)
    attach_lora(wider, rank=4, alpha=8.0)
    before = {k: v.clone() for k, v in adapter_state(wider).items()}
    with pytest.raises(UserError, match="another base model"):
        import_peft(wider, out, "qwen3")
    assert all(torch.equal(before[k], v) for k, v in adapter_state(wider).items())
    problems = config_problems(out, rank=8, alpha=4.0)
    assert any("set lora.rank = 4" in p for p in problems)
    assert any("set lora.alpha = 8.0" in p for p in problems)
    assert config_problems(out, rank=4, alpha=8.0) == []


@pytest.mark.parametrize("change,match", [
    ({"use_dora": True}, "use_dora"),
    ({"use_rslora": True}, "use_rslora"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"bias": "all"}, "bias"),
    ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    ({"peft_type": "IA3"}, "LoRA adapters only"),
])
def test_folders_qarl_cannot_run_are_refused_by_name(tmp_path, change, match):
    out = write_peft(_trained(_model()), tmp_path / "adapter", "base", "qwen3")
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(UserError, match=match):
        read_config(out)


def test_missing_or_broken_files_are_named(tmp_path):
    """A folder without the config, a config that is not JSON or not an object, an r that is
    not a whole number, an adapter file cut short: each a UserError naming the file."""
    with pytest.raises(UserError, match="has no adapter_config.json"):
        read_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{not json")
    (tmp_path / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match="is not JSON"):
        read_config(tmp_path)
    (tmp_path / "adapter_config.json").write_text("[]")
    with pytest.raises(UserError, match="adapter_config.json holds a JSON list, not the object"):
        read_config(tmp_path)
    out = write_peft(_trained(_model()), tmp_path / "adapter", "base", "qwen3")
    config = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**config, "r": "four"}))
    with pytest.raises(UserError, match="r = 'four', lora_alpha = 8.0; a LoRA adapter has a whole r"):
        read_config(out)
    (out / "adapter_config.json").write_text(json.dumps(config))
    weights = out / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])
    with pytest.raises(UserError, match="adapter_model.safetensors is cut short"):
        read_config(out)


def test_a_full_weight_model_has_nothing_to_write(tmp_path):
    with pytest.raises(UserError, match="no LoRA adapters"):
        write_peft(_model(), tmp_path / "x", "base", "qwen3")
