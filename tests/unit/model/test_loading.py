"""save_model / load_model round trips, HF folders (single and sharded), and clear errors."""

from __future__ import annotations

import json

import pytest

from qarl.errors import UserError
import torch

from qarl.model import load_model, save_model
from qarl.model.config import ModelConfig
from qarl.model.zoo import init_tiny

from .conftest import make_hf_model

ATOL = 1e-5  # fp32 logits, our attention vs HF's: see test_decoder_parity
IDS = torch.randint(0, 97, (2, 23), generator=torch.Generator().manual_seed(0))


def small_config(**overrides) -> ModelConfig:
    kwargs = dict(family="qwen3", vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=50000.0)
    return ModelConfig(**{**kwargs, **overrides})


@pytest.mark.parametrize("tied", [True, False])
def test_save_load_round_trip_is_exact(tmp_path, tied):
    """save_model then load_model gives bit-identical tensors, the same config and the same
    tying; a tied model stores its embedding once (no lm_head.weight in the file)."""
    from safetensors import safe_open

    model = init_tiny(small_config(family="qwen2", attention_bias=True, tie_word_embeddings=tied), seed=3)
    save_model(model, tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not tied)
    loaded = load_model(tmp_path)
    assert loaded.config == model.config
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    assert model.state_dict().keys() == loaded.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    assert torch.equal(model.inv_freq, loaded.inv_freq)
    with torch.no_grad():
        assert torch.equal(model.logits(IDS), loaded.logits(IDS))


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("shard", [False, True])
def test_load_save_pretrained_folder(tmp_path, family, shard):
    """A folder written by HF save_pretrained (one file, or shards + index) loads with the
    same logits as the HF model (within 1e-5)."""
    hf = make_hf_model(family, tied=family == "llama", seed=11)
    hf.save_pretrained(tmp_path, max_shard_size="20KB" if shard else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    ours = load_model(tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(IDS), hf(IDS).logits, atol=ATOL, rtol=0)


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_loads_our_folder(tmp_path, tied):
    """transformers' AutoModelForCausalLM loads a save_model folder, giving the same logits
    (within 1e-5), with llama3 rope scaling carried through config.json."""
    from transformers import AutoModelForCausalLM

    scaling = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    model = init_tiny(small_config(family="llama", tie_word_embeddings=tied, rope_scaling=scaling), seed=5)
    save_model(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_theta"] == 50000.0
    ids = torch.randint(0, 97, (1, 90), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.logits(ids), atol=ATOL, rtol=0)


def test_load_in_bfloat16_keeps_rope_in_float32(tmp_path):
    """dtype=bfloat16 gives bf16 weights equal to the fp32 ones rounded, RoPE table in fp32."""
    model = init_tiny(small_config(), seed=1)
    save_model(model, tmp_path)
    loaded = load_model(tmp_path, dtype=torch.bfloat16)
    weight = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(loaded.get_parameter(weight), model.get_parameter(weight).to(torch.bfloat16))
    assert loaded.inv_freq.dtype == torch.float32


def test_error_nonexistent_path_lists_zoo_names(qarl_home):
    """A path that does not exist (and is no zoo name) says so and lists the zoo names."""
    with pytest.raises(UserError, match=r"neither an existing path.*smollm2-135m.*tiny"):
        load_model("/no/such/model")


def test_error_folder_without_config(tmp_path):
    """A folder without config.json says what a model folder must contain."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UserError, match=r"no config.json: a model folder must contain config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "GPT2LMHeadModel"])
def test_error_unsupported_architecture_lists_supported(tmp_path, arch):
    """An unsupported architecture names itself and the supported ones."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], "model_type": "x"}))
    with pytest.raises(ValueError, match=rf"{arch}.*LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        load_model(tmp_path)


def test_error_missing_and_unexpected_weights_are_listed(tmp_path):
    """Weights that do not fit the config are reported by name (missing and unexpected)."""
    from safetensors.torch import load_file, save_file

    save_model(init_tiny(small_config(), seed=0), tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.0.extra.weight"] = state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"1 missing.*layers.1.mlp.up_proj.*1 unexpected.*layers.0.extra"):
        load_model(tmp_path)


def test_error_pickle_only_folder_is_refused(tmp_path):
    """A folder with only pytorch_model.bin is refused (never unpickled), naming the file."""
    save_model(init_tiny(small_config(), seed=0), tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match=r"pytorch_model.bin.*never unpickles"):
        load_model(tmp_path)


def test_a_skeleton_is_the_model_without_its_weights(tiny_dir):
    """load_skeleton gives load_model's structure (same parameter names, shapes and dtype,
    lm_head tied to the embedding as in the folder's config) with every parameter on the meta
    device, and RoPE frequencies equal to the loaded model's."""
    from qarl.model import load_skeleton

    whole, skeleton = load_model(tiny_dir), load_skeleton(tiny_dir)
    shapes = {n: (p.shape, p.dtype) for n, p in whole.named_parameters()}
    assert {n: (p.shape, p.dtype) for n, p in skeleton.named_parameters()} == shapes
    assert all(p.is_meta for p in skeleton.parameters())
    tied = whole.config.tie_word_embeddings
    assert (skeleton.lm_head.weight is skeleton.model.embed_tokens.weight) == tied
    assert torch.equal(skeleton.inv_freq, whole.inv_freq)
