"""Qwen3-MoE: parity with transformers, expert dispatch, routing control, loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qarl.model import CausalLM, ModelConfig, load_model, save_model
from qarl.model.loading import build_model, model_config_from_hf
from qarl.model.moe import Routing, dispatch, route

ATOL = 1e-5  # as the dense parity tests: fp32 logits of size ~1 after 3 layers


def make_hf_moe(seed: int = 0, norm_topk_prob: bool = True, mlp_only_layers=(), num_kv_heads=2,
                decoder_sparse_step: int = 1):
    """A small transformers Qwen3MoeForCausalLM, every parameter random (norms ~1, others ~0.05;
    the router ~0.5 so that its top-k is decided by clear margins)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
        mlp_only_layers=list(mlp_only_layers), decoder_sparse_step=decoder_sparse_step,
        rope_theta=50000.0, max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    model = Qwen3MoeForCausalLM(config).to(torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            scale = 0.5 if name.endswith("mlp.gate.weight") else 0.05
            param.copy_(1 + 0.2 * noise if "norm" in name else scale * noise)
    return model


def ours_via_disk(hf_model, folder: Path, **save_kwargs) -> CausalLM:
    """Our model read from the folder transformers' save_pretrained writes (per-expert names)."""
    hf_model.save_pretrained(folder, **save_kwargs)
    return load_model(folder)


@pytest.mark.parametrize("norm_topk_prob,mlp_only_layers,num_kv_heads,sparse_step", [
    (True, (), 2, 1), (False, (), 4, 1), (True, (1,), 1, 1), (False, (), 2, 2),
])
def test_logits_and_greedy_match_transformers(tmp_path, norm_topk_prob, mlp_only_layers,
                                              num_kv_heads, sparse_step):
    """Logits equal HF's within 1e-5 (fp32) and 12 greedy tokens are equal, with and without
    norm_topk_prob, with a dense layer among MoE ones (mlp_only_layers, decoder_sparse_step),
    with GQA / MHA / MQA; loaded from the folder transformers writes."""
    hf = make_hf_moe(seed=len(mlp_only_layers) + num_kv_heads, norm_topk_prob=norm_topk_prob,
                     mlp_only_layers=mlp_only_layers, num_kv_heads=num_kv_heads,
                     decoder_sparse_step=sparse_step)
    ours = ours_via_disk(hf, tmp_path)
    expected_moe = tuple(i for i in range(3) if i not in mlp_only_layers and (i + 1) % sparse_step == 0)
    assert ours.config.moe_layers == expected_moe
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours.logits(ids)
        assert expected.abs().max() > 0.1
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        prompt = ids[:1, :8]
        hf_tokens = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, 8:]
        seq = prompt
        for _ in range(12):
            seq = torch.cat([seq, ours.logits(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(seq[0, 8:], hf_tokens)


def test_dispatch_equals_per_token_loop():
    """Grouped dispatch equals the definition y[m] = sum_j w[m,j] expert_{e[m,j]}(x[m]) computed
    token by token, within fp32 rounding of a different GEMM row count (1e-6)."""
    g = torch.Generator().manual_seed(0)
    experts = [torch.nn.Linear(8, 8) for _ in range(5)]
    x = torch.randn(40, 8, generator=g)
    weights, chosen, own = route(torch.randn(40, 5, generator=g), 2, True)
    assert torch.equal(chosen, own)
    with torch.no_grad():
        got = dispatch(x, chosen, weights, experts)
        want = torch.stack([sum(weights[m, j] * experts[int(chosen[m, j])](x[m]) for j in range(2))
                            for m in range(40)])
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_route_with_forced_experts():
    """Forcing the router's own choice changes nothing (bit for bit); forcing others uses them,
    weighted by this router's probabilities; -1 rows keep the router's own choice."""
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(1))
    w, e, own = route(logits, 2, True)
    w2, e2, _ = route(logits, 2, True, forced=own.to(torch.int16))
    assert torch.equal(w, w2) and torch.equal(e, e2)
    forced = torch.tensor([[0, 1]] * 3 + [[-1, -1]] * 3, dtype=torch.int16)
    w3, e3, own3 = route(logits, 2, False, forced=forced)
    assert torch.equal(own3, own) and torch.equal(e3[:3], torch.tensor([[0, 1]] * 3))
    assert torch.equal(e3[3:], own[3:])
    assert torch.equal(w3[:3], torch.softmax(logits, -1)[:3, :2])


def test_routing_record_and_replay(tmp_path):
    """A forward records each MoE layer's top-k; replaying the recorded experts gives the same
    logits bit for bit; replaying other experts makes the layers use them (chosen stays the
    router's own choice: the same in the first layer) and changes the logits."""
    model = ours_via_disk(make_hf_moe(seed=3), tmp_path)
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        rec = Routing()
        logits = model.logits(ids, routing=rec)
        recorded = rec.chosen_experts(3)  # [2, 10, 3, 2] int16
        assert recorded.shape == (2, 10, 3, 2) and recorded.dtype == torch.int16
        same = Routing(replay=recorded)
        assert torch.equal(model.logits(ids, routing=same), logits)
        assert torch.equal(same.chosen_experts(3), recorded)
        other = Routing(replay=(recorded + 1) % 6)  # still k distinct experts per token
        assert not torch.allclose(model.logits(ids, routing=other), logits)
        # the first MoE layer's input does not depend on the replay: same own choice there
        assert torch.equal(other.chosen_experts(3)[:, :, 0], recorded[:, :, 0])


def test_replay_of_wrong_shape_is_refused(tmp_path):
    """A replay tensor for other tokens fails with the shapes named."""
    model = ours_via_disk(make_hf_moe(seed=3), tmp_path)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="does not fit a forward"):
        model(ids, routing=Routing(replay=torch.zeros(1, 5, 3, 2, dtype=torch.int16)))


def test_sharded_checkpoint_and_round_trip(tmp_path):
    """Sharded HF folders load (experts spread over shards); save_model writes per-expert names
    and config keys that both qarl and transformers read back to the same logits."""
    hf = make_hf_moe(seed=5)
    ours = ours_via_disk(hf, tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    save_model(ours, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert written["num_experts"] == 6 and written["architectures"] == ["Qwen3MoeForCausalLM"]
    from transformers import AutoModelForCausalLM

    again = load_model(tmp_path / "ours")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32).eval()
    ids = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(again.logits(ids), ours.logits(ids))
        torch.testing.assert_close(theirs(ids).logits, ours.logits(ids), atol=ATOL, rtol=0)


def test_invalid_moe_config_is_refused():
    """k > E and missing expert sizes are named in one error."""
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig(family="qwen3_moe", num_experts=4, num_experts_per_tok=5, moe_intermediate_size=8)
    config = model_config_from_hf({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 8,
                                   "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
                                   "num_attention_heads": 2, "num_local_experts": 2,
                                   "num_experts_per_tok": 1, "moe_intermediate_size": 4},
                                  source=Path("<x>"))
    assert config.num_experts == 2 and build_model  # transformers 5's key is read too
