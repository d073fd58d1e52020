"""Random Hugging Face reference models for the decoder parity tests."""

from __future__ import annotations

import pytest
import torch

FAMILIES = ("llama", "qwen2", "qwen3")


def make_hf_model(family: str, tied: bool, seed: int = 0, rope_scaling: dict | None = None,
                  vocab_size: int = 97, num_kv_heads: int = 2):
    """A small transformers model of `family`, EVERY parameter random (HF inits norms to 1 and
    biases to 0, which would hide a swapped or missing norm / bias)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=50000.0, max_position_embeddings=256, tie_word_embeddings=tied,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    config = AutoConfig.for_model(family, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():  # a tied lm_head is listed once
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1 + 0.2 * noise if "norm" in name else 0.05 * noise)
    return model


@pytest.fixture(scope="module")
def hf_model_factory():
    return make_hf_model
