"""Our decoder against transformers' own Llama / Qwen2 / Qwen3 on random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qarl.model.loading import build_model, model_config_from_hf

from .conftest import FAMILIES, make_hf_model

LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
# fp32 logits of size ~1 after 2 layers: reduction-order differences between our SDPA call
# and HF's attention are ~1e-7 per op; 1e-5 leaves room for accumulation, nothing more.
ATOL = 1e-5


def ours_from_hf(hf_model):
    """Our CausalLM built from the HF model's config dict and state dict (the loading path)."""
    config = model_config_from_hf(hf_model.config.to_dict(), source=Path("<hf>"))
    return build_model(config, dict(hf_model.state_dict()), torch.float32, source=Path("<hf>"))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [True, False])
def test_logits_match_transformers(family, tied):
    """Logits equal HF's within 1e-5 (fp32) for each family, tied and untied, with GQA
    (4 query heads / 2 KV heads), non-default rope_theta and every parameter random."""
    hf = make_hf_model(family, tied, seed=2 * FAMILIES.index(family) + tied)
    ours = ours_from_hf(hf)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == tied
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours.logits(ids)
    assert expected.abs().max() > 0.1  # the comparison is not between near-zero tensors
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_llama3_rope_scaling_matches_transformers():
    """Llama 3.1 RoPE scaling (all three frequency bands: head_dim 16 with theta 5e4 gives
    wavelengths below, inside and above [16, 64]) over 100 positions matches HF within 1e-5."""
    hf = make_hf_model("llama", tied=False, seed=3, rope_scaling=LLAMA3_SCALING)
    ours = ours_from_hf(hf)
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    ids = torch.randint(0, 97, (1, 100), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ids), hf(ids).logits, atol=ATOL, rtol=0)


def test_multi_query_attention_matches_transformers():
    """One KV head shared by all 4 query heads (the extreme of GQA) matches HF within 1e-5."""
    hf = make_hf_model("qwen3", tied=True, seed=4, num_kv_heads=1)
    ours = ours_from_hf(hf)
    ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours.logits(ids), hf(ids).logits, atol=ATOL, rtol=0)
