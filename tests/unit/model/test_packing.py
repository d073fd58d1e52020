"""The packed forward (`Packing`): only the kept positions are computed, with the values the
padded forward gives them."""

from __future__ import annotations

import pytest
import torch

from qarl.model.cache import SharedPrefixCache
from qarl.model.config import ModelConfig
from qarl.model.decoder import Packing
from qarl.model.zoo import init_tiny

# The packed and padded passes run the same per-row math through GEMMs of other heights:
# fp32 rounding only (~1e-7 relative on hidden states of size ~1 after 2 layers).
ATOL = 1e-5


@pytest.fixture(scope="module")
def model():
    config = ModelConfig(
        family="qwen3", vocab_size=101, hidden_size=64, intermediate_size=96, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=False,
    )
    model = init_tiny(config, seed=3)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # widen init_tiny's unit norms and small weights
        for name, p in model.named_parameters():
            p.copy_(p + 0.2 * torch.randn(p.shape, generator=generator) if "norm" in name else 3.0 * p)
    return model


def _rows(lengths: list[int], width: int, left: bool) -> torch.Tensor:  # -> [B, width] bool
    n = torch.tensor(lengths)[:, None]
    t = torch.arange(width)[None, :]
    return t >= width - n if left else t < n


def test_packing_round_trips_the_kept_positions():
    keep = _rows([3, 0, 5], 5, left=False)
    packing = Packing.of(keep)
    x = torch.randn(3, 5, 2)
    packed = packing.pack(x)
    assert packed.shape == (8, 2)
    assert torch.equal(packed, x[keep])
    assert torch.equal(packing.pad(packed), x * keep[..., None])


def test_a_packed_forward_gives_the_padded_forward_at_its_positions(model):
    """Left-padded rows of several lengths in one pass: the packed forward's hidden states are
    the padded forward's at the real positions, and it computes those positions only."""
    real = _rows([9, 4, 7, 1], 9, left=True)
    ids = torch.randint(0, 101, real.shape, generator=torch.Generator().manual_seed(0))
    positions = (real.cumsum(1) - 1).clamp(min=0)
    rows = []
    hook = model.model.layers[1].mlp.up_proj.register_forward_hook(
        lambda _m, args, _out: rows.append(args[0].shape[:-1].numel()))
    try:
        with torch.no_grad():
            padded = model(ids, positions=positions, key_mask=real)  # [4, 9, H]
            packed = model(ids, positions=positions, key_mask=real, packed=real)  # [21, H]
    finally:
        hook.remove()
    assert rows == [4 * 9, 21]
    assert packed.shape == (21, padded.shape[-1])
    assert torch.allclose(packed, padded[real], rtol=0, atol=ATOL)


def test_a_packed_continuation_over_a_cache_gives_the_padded_one(model):
    """A prompt run into the learner's prefix cache, then responses of different lengths
    right-padded: packing the continuation changes no kept position's value (beyond rounding),
    and its gradient reaches the weights as the padded one's does."""
    B, P, T = 3, 5, 6
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 101, (B, P), generator=gen)
    cont = torch.randint(0, 101, (B, T), generator=gen)
    keep = _rows([6, 2, 4], T, left=False)
    key_mask = torch.cat([torch.ones(B, P, dtype=torch.bool), keep], dim=1)
    positions = torch.arange(P, P + T).expand(B, T)
    out = {}
    for packed in (None, keep):
        model.zero_grad()
        cache = SharedPrefixCache(torch.arange(B))
        model(prompt, cache=cache)
        hidden = model(cont, positions=positions, cache=cache, cache_start=P, key_mask=key_mask,
                       packed=packed)
        hidden = hidden[keep] if packed is None else hidden
        weights = torch.randn(hidden.shape, generator=torch.Generator().manual_seed(5))
        (hidden * weights).sum().backward()
        out[packed is None] = hidden.detach(), model.model.layers[0].mlp.down_proj.weight.grad.clone()
    assert torch.allclose(out[False][0], out[True][0], rtol=0, atol=ATOL)
    grad, ref = out[False][1], out[True][1]
    assert (grad - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_a_packing_with_a_hole_before_a_kept_position_is_refused(model):
    real = torch.ones(2, 4, dtype=torch.bool)
    keep = real.clone()
    keep[1, 1] = False  # row 1 keeps position 2, whose query attends position 1
    with pytest.raises(ValueError, match="row 1 keeps a position after its position 1"):
        model(torch.zeros(2, 4, dtype=torch.long), key_mask=real, packed=keep)
