"""Small random decoders (and their `transformers` twins) for the rollout tests."""

from __future__ import annotations

import pytest
import torch

from qarl.model import CausalLM, ModelConfig



def build_model(family: str = "qwen3", seed: int = 0, dtype=torch.float32, **overrides) -> CausalLM:
    """A 2-layer random decoder whose next-token distributions are neither flat nor one-hot.

    Untied embeddings, and lm_head scaled x4 so logits have a spread of a few nats: with the
    default init the model is either near-uniform (tied: it repeats its input) or flat.
    """
    fields = dict(
        family=family, vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, tie_word_embeddings=False, attention_bias=family == "qwen2",
        max_position_embeddings=256,
    )
    fields.update(overrides)
    torch.manual_seed(seed)
    model = CausalLM(ModelConfig(**fields))
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)
    return model.to(dtype).eval()


def hf_twin(model: CausalLM):
    """The `transformers` model of the same family with the same weights (SDPA attention)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = model.config.to_hf()
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    twin = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    twin.load_state_dict(model.state_dict(), strict=True)
    return twin.to(model.lm_head.weight.dtype).eval()


@pytest.fixture
def make_model():
    return build_model


@pytest.fixture
def make_hf_twin():
    return hf_twin
