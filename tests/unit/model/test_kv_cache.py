"""KV-cache decoding against the full forward, including left-padded batches."""

from __future__ import annotations

import pytest
import torch

from qarl.model.config import ModelConfig
from qarl.model.zoo import init_tiny

# Decoding one query over the cache takes another SDPA path than the full causal pass
# (measured up to 8e-7 apart, docs/design.md); 1e-5 on logits of size ~1 after 2 layers.
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    config = ModelConfig(
        family="qwen2", vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False, attention_bias=True,
    )
    model = init_tiny(config, seed=7)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # init_tiny gives unit norms and N(0, 0.02^2) weights: widen both
        for name, p in model.named_parameters():
            p.copy_(p + 0.2 * torch.randn(p.shape, generator=generator) if "norm" in name else 3.0 * p)
    return model


def test_prefill_then_decode_equals_full_forward(model):
    """Prefill of a prompt then 5 one-token decode steps give the logits of the full forward
    at the same positions (within 1e-5)."""
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(0))
    prompt_len = 7
    with torch.no_grad():
        full = model.logits(ids)  # [2, 12, vocab]
        cache = model.new_cache(2, 12)
        steps = [model.logits(ids[:, :prompt_len], cache=cache)[:, -1]]
        for t in range(prompt_len, 12):
            steps.append(model.logits(ids[:, t:t + 1], cache=cache, cache_start=t)[:, -1])
    assert full.abs().max() > 0.1
    torch.testing.assert_close(torch.stack(steps[:-1], 1), full[:, prompt_len - 1:-1], atol=ATOL, rtol=0)
    torch.testing.assert_close(steps[-1], full[:, -1], atol=ATOL, rtol=0)


def test_left_padded_batch_equals_each_row_alone(model):
    """A left-padded batch (rows of length 5, 3, 7) with per-row RoPE positions and key_mask,
    prefilled then decoded 4 steps, gives each row's logits as that row alone (within 1e-5),
    whatever token the padding holds."""
    gen = torch.Generator().manual_seed(5)
    lengths, steps = [5, 3, 7], 4
    prompts = [torch.randint(0, 101, (n,), generator=gen) for n in lengths]
    new_tokens = torch.randint(0, 101, (3, steps), generator=gen)  # fed back one by one
    T = max(lengths)
    pad = torch.tensor([T - n for n in lengths])  # [B]
    ids = torch.stack([torch.cat([torch.full((T - len(p),), 99), p]) for p in prompts])  # [B, T]
    slots = torch.arange(T + steps)
    key_mask = slots[None, :] >= pad[:, None]  # [B, T + steps]
    positions = (torch.arange(T)[None, :] - pad[:, None]).clamp(min=0)  # [B, T]
    with torch.no_grad():
        cache = model.new_cache(3, T + steps)
        batched = [model.logits(ids, positions=positions, cache=cache, key_mask=key_mask)[:, -1]]
        for s in range(steps):
            pos = (torch.tensor(lengths) + s)[:, None]  # [B, 1]
            out = model.logits(new_tokens[:, s:s + 1], positions=pos, cache=cache, cache_start=T + s, key_mask=key_mask)
            batched.append(out[:, -1])
        batched = torch.stack(batched, 1)  # [B, steps + 1, vocab]
        for b, prompt in enumerate(prompts):
            alone = model.logits(torch.cat([prompt, new_tokens[b]])[None])[0]  # [n + steps, vocab]
            torch.testing.assert_close(batched[b], alone[len(prompt) - 1:], atol=ATOL, rtol=0)
