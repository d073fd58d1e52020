"""Greedy decoding agrees with `transformers` `generate` on the same weights."""

from __future__ import annotations

import pytest
import torch

from qarl.rollout import LocalEngine
from qarl.types import SamplingParams

# qwen3 (q/k norms, GQA) runs by default; the other families cost ~5 s each: `-m slow`.
FAMILIES = [
    pytest.param("llama", marks=pytest.mark.slow),
    pytest.param("qwen2", marks=pytest.mark.slow),
    "qwen3",
]

PROMPTS = [[5, 17, 3, 99, 42], [7, 8], [1, 2, 3, 4, 5, 6, 9]]


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_equal_transformers_generate(make_model, make_hf_twin, family):
    """On a ragged left-padded batch, our greedy tokens equal HF greedy tokens
    (`do_sample=False`, same left padding and attention mask) for every family."""
    model = make_model(family=family)
    twin = make_hf_twin(model)
    batch = LocalEngine(model, eos_token_ids=(), pad_token_id=0).generate(
        PROMPTS, SamplingParams(max_new_tokens=16, greedy=True), seed=0
    )
    with torch.no_grad():
        out = twin.generate(
            input_ids=batch.prompt_ids, attention_mask=batch.prompt_mask.long(), do_sample=False,
            max_new_tokens=16, min_new_tokens=16, pad_token_id=0, eos_token_id=None,
        )
    assert torch.equal(batch.response_ids, out[:, batch.prompt_ids.shape[1] :])
