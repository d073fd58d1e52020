"""Sparse upcycling (dense -> MoE with the same function) and the Mixtral family it gives Llama."""

from __future__ import annotations

import json

import pytest
import torch

from qarl.model import ModelConfig, load_model, save_model
from qarl.model.names import name_in_memory, name_on_disk
from qarl.model.upcycle import upcycle, upcycled_config
from qarl.model.zoo import init_tiny, tiny_config

# fp32 rounding only: each MoE layer computes w1 * f + w2 * f with w1 + w2 = 1 within an ulp
# (vs f); measured max |Δlogit| 8e-7 on tiny (|logit| <= 1.6, 4 layers).
TINY_ATOL = 1e-5


def small_llama(seed: int = 0):
    config = ModelConfig(family="llama", vocab_size=97, hidden_size=64, intermediate_size=96,
                         num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16,
                         rope_theta=50000.0, tie_word_embeddings=False, eos_token_id=2)
    model = init_tiny(config, seed=seed)
    with torch.no_grad():  # weights of size ~0.3 so that rounding errors would show
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(15)
    return model


def ids_batch(vocab: int, seed: int = 1):  # [3, 24] int64
    return torch.randint(0, vocab, (3, 24), generator=torch.Generator().manual_seed(seed))


def test_upcycled_tiny_equals_dense_tiny():
    """tiny upcycled to 4 experts (top-2) is a qwen3_moe model whose logits equal dense tiny's
    within fp32 rounding (TINY_ATOL), whatever experts its random routers pick."""
    dense = init_tiny(tiny_config(1024, 3))
    moe = upcycle(dense, num_experts=4, top_k=2, seed=0)
    c = moe.config
    assert (c.family, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
            c.norm_topk_prob, c.moe_layers) == ("qwen3_moe", 4, 2, 768, True, (0, 1, 2, 3))
    ids = ids_batch(1024)
    with torch.no_grad():
        expected, got = dense.logits(ids), moe.logits(ids)
    torch.testing.assert_close(got, expected, atol=TINY_ATOL, rtol=0)
    assert expected.abs().max() > 0.5


def test_upcycle_copies_experts_seeds_routers_and_leaves_dense_alone():
    """Every expert is a bit-exact copy of its layer's dense MLP held in its own storage; the
    routers are N(0, 0.02^2) from the seed (the same seed gives the same routers, another seed
    others); the dense model is unchanged."""
    dense = init_tiny(tiny_config(1024, 3))
    before = {k: v.clone() for k, v in dense.state_dict().items()}
    a, b, other = (upcycle(dense, 4, 2, seed=s) for s in (0, 0, 1))
    for layer in range(4):
        mlp = dense.model.layers[layer].mlp
        for e in range(4):
            expert = a.model.layers[layer].mlp.experts[e]
            for proj in ("gate_proj", "up_proj", "down_proj"):
                mine, theirs = getattr(expert, proj).weight, getattr(mlp, proj).weight
                assert torch.equal(mine, theirs) and mine.data_ptr() != theirs.data_ptr()
        router = a.model.layers[layer].mlp.gate.weight  # [4, 256]
        assert router.shape == (4, 256) and 0.015 < float(router.detach().std()) < 0.025
        assert torch.equal(router, b.model.layers[layer].mlp.gate.weight)
        assert not torch.equal(router, other.model.layers[layer].mlp.gate.weight)
    for name, tensor in dense.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_llama_becomes_mixtral_with_the_same_function(tmp_path):
    """A Llama model upcycles into Mixtral (Llama attention kept: no q/k norm) with logits
    within fp32 rounding of the dense model's; save_model writes Mixtral's checkpoint names
    and config keys, and load_model reads the folder back bit for bit."""
    dense = small_llama()
    moe = upcycle(dense, num_experts=4, top_k=2, seed=0)
    assert moe.config.family == "mixtral" and moe.model.layers[0].self_attn.q_norm is None
    ids = ids_batch(97)
    with torch.no_grad():
        expected, got = dense.logits(ids), moe.logits(ids)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert expected.abs().max() > 2

    save_model(moe, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert (hf["architectures"], hf["num_local_experts"], hf["num_experts_per_tok"],
            hf["intermediate_size"], hf["sliding_window"]) == (["MixtralForCausalLM"], 4, 2, 96, None)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.2.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any(".mlp." in n for n in names)
    again = load_model(tmp_path)
    assert again.config == moe.config
    for name, tensor in moe.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_mixtral_folder_matches_transformers(tmp_path):
    """transformers' MixtralForCausalLM loads an upcycled model's save_model folder and gives
    the same logits within 1e-5 (fp32); routers are scaled up so that the experts, made to
    differ, matter."""
    from transformers import AutoModelForCausalLM

    moe = upcycle(small_llama(), num_experts=4, top_k=2, seed=0, router_std=0.5)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in moe.named_parameters():
            if ".experts." in name:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))
    save_model(moe, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    ids = ids_batch(97)
    with torch.no_grad():
        torch.testing.assert_close(moe.logits(ids), hf(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("memory,disk", [
    ("model.layers.3.mlp.gate.weight", "model.layers.3.block_sparse_moe.gate.weight"),
    ("model.layers.0.mlp.experts.7.gate_proj.weight", "model.layers.0.block_sparse_moe.experts.7.w1.weight"),
    ("model.layers.0.mlp.experts.12.up_proj.weight_scale", "model.layers.0.block_sparse_moe.experts.12.w3.weight_scale"),
    ("model.layers.1.mlp.experts.0.down_proj", "model.layers.1.block_sparse_moe.experts.0.w2"),
    ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"),
])
def test_mixtral_names_map_both_ways(memory, disk):
    """Mixtral's checkpoint names <-> the decoder's, for tensors, compressed-tensors leaves and
    bare module names (quantization targets); other names and other families pass unchanged."""
    assert name_on_disk("mixtral", memory) == disk and name_in_memory("mixtral", disk) == memory
    assert name_on_disk("qwen3_moe", memory) == memory


def test_families_without_an_upcycled_form_are_refused():
    """Upcycling a Qwen2 model (q/k/v bias: no MoE family here has it) says which families can."""
    config = ModelConfig(family="qwen2", attention_bias=True)
    with pytest.raises(ValueError, match=r"cannot upcycle a qwen2 model.*\['llama', 'qwen3'\]"):
        upcycled_config(config, 4, 2)


def test_mixtral_config_round_trips_and_refuses_what_it_cannot_run():
    """A Mixtral config.json reads as every-layer MoE, experts intermediate_size wide, top-k
    renormalized, and writes back the same keys; a sliding window or a partial MoE is refused."""
    hf = {"architectures": ["MixtralForCausalLM"], "vocab_size": 97, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
          "sliding_window": None, "router_aux_loss_coef": 0.02}
    config = ModelConfig.from_hf(hf)
    assert (config.num_experts, config.moe_intermediate_size, config.norm_topk_prob,
            config.moe_layers, config.qk_norm) == (8, 96, True, (0, 1), False)
    back = config.to_hf()
    assert {k: back[k] for k in hf} == hf
    with pytest.raises(ValueError, match="sliding_window = 4096 is not supported"):
        ModelConfig.from_hf({**hf, "sliding_window": 4096})
    with pytest.raises(ValueError, match="invalid mixtral config.*MoE MLP in every layer"):
        ModelConfig(family="mixtral", num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=8, norm_topk_prob=True, mlp_only_layers=[1])


def test_mixtral_compressed_tensors_export_uses_mixtral_names(tmp_path):
    """A quantized Mixtral written as compressed-tensors (what `qarl export` and the vLLM
    policy folder write) names its expert tensors and quantization targets as Mixtral
    checkpoints do, and qarl reads the codes back under them."""
    from qarl.export import read_ct
    from qarl.export.run import RunPolicy, write_compressed_tensors

    moe = upcycle(small_llama(), num_experts=4, top_k=2, seed=0)
    policy = RunPolicy(tmp_path / "unused", "unused", "float32", "w8a8-int8")
    write_compressed_tensors(moe, policy, "w8a8-int8", tmp_path / "ct")
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    targets = config["quantization_config"]["config_groups"]["group_0"]["targets"]
    assert "model.layers.1.block_sparse_moe.experts.3.w2" in targets
    assert "model.layers.1.block_sparse_moe.gate" in config["quantization_config"]["ignore"]
    assert not any(".mlp." in t for t in targets)
    state = read_ct(tmp_path / "ct")
    assert state["model.layers.0.block_sparse_moe.experts.0.w1.weight"].scheme == "w8a8-int8"
