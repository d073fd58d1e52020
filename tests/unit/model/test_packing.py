"""The packed forward (`Packing`): only the kept positions are computed, with the values the
padded forward gives them."""

from __future__ import annotations

import contextlib

import pytest
import torch

from qarl.model.cache import SharedPrefixCache
from qarl.model.config import ModelConfig
from qarl.model.packing import Packing
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


def _shared_case(model, seed: int = 4):
    """Two prompts (the second left-padded by 3) of 24 tokens, three rows each, and each row's
    continuation of 20 tokens with its own length: enough rows for every GEMM path to be
    the same in both forms (each part has 16 rows or more)."""
    G, P, B, T = 2, 24, 6, 20
    gen = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(G, P, dtype=torch.bool)
    prompt_mask[1, :3] = False
    prompts = torch.randint(0, 101, (G, P), generator=gen)
    rows = torch.tensor([0, 0, 0, 1, 1, 1])
    cont = torch.randint(0, 101, (B, T), generator=gen)
    keep = _rows([20, 7, 13, 1, 20, 16], T, left=False)
    key_mask = torch.cat([prompt_mask[rows], keep], dim=1)
    prompt_positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
    positions = prompt_positions[rows, -1:] + 1 + torch.arange(T)[None, :]
    return prompts, prompt_positions, prompt_mask, rows, cont, positions, key_mask, keep


def _both_forms(model, case, shared: bool):
    """Hidden states (prompts [G, P, H], continuation [n, H]) and every weight's gradient of a
    fixed weighting of them, by `forward_shared` or by the two forwards it stands for."""
    prompts, prompt_positions, prompt_mask, rows, cont, positions, key_mask, keep = case
    model.zero_grad()
    cache = SharedPrefixCache(rows)
    if shared:
        first, rest = model.forward_shared(prompts, prompt_positions, prompt_mask, cont,
                                           positions, key_mask, keep, cache)
    else:
        first = model(prompts, positions=prompt_positions, key_mask=prompt_mask, cache=cache)
        rest = model(cont, positions=positions, cache=cache, cache_start=prompts.shape[1],
                     key_mask=key_mask, packed=keep)
    gen = torch.Generator().manual_seed(5)
    loss = (first * torch.randn(first.shape, generator=gen)).sum() + (
        rest * torch.randn(rest.shape, generator=gen)).sum()
    loss.backward()
    return first.detach(), rest.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                            if p.grad is not None}


def test_a_shared_prompt_forward_is_the_prompt_then_continuation_forwards(model):
    """One pass of the prompts and the packed continuation gives the two forwards' hidden
    states and weight gradients (fp32: GEMM rounding only), each layer's weights meeting one
    GEMM of all the tokens."""
    case = _shared_case(model)
    heights = []
    hook = model.model.layers[1].mlp.up_proj.register_forward_hook(
        lambda _m, args, _out: heights.append(args[0].shape[:-1].numel()))
    try:
        shared = _both_forms(model, case, shared=True)
    finally:
        hook.remove()
    two = _both_forms(model, case, shared=False)
    assert heights == [2 * 24 + int((case[-1]).sum())]  # one call: G x P + the kept positions
    assert torch.allclose(shared[0], two[0], rtol=0, atol=ATOL)
    assert torch.allclose(shared[1], two[1], rtol=0, atol=ATOL)
    # every weight but lm_head's (the forward gives hidden states)
    assert shared[2].keys() == two[2].keys() == {n for n, _ in model.named_parameters()} - {
        "lm_head.weight"}
    for name, ref in two[2].items():
        assert (shared[2][name] - ref).abs().max() <= 1e-5 * ref.abs().max(), name


def test_a_shared_prompt_forward_on_the_int8_kernel_is_bit_for_bit(model):
    """W8A8 in kernel alignment: a projection's output rows depend on their own row only
    (per-token activation scales, exact int32 sums), so one pass over both parts' tokens
    gives the two forwards' hidden states and gradient dL/dx exactly; the weights' gradients
    sum the same products at another GEMM height (fp32 rounding)."""
    import copy

    from qarl.quant import quantize_model

    quantized = quantize_model(copy.deepcopy(model), "w8a8-int8", mode="kernel")
    case = _shared_case(quantized)
    shared = _both_forms(quantized, case, shared=True)
    two = _both_forms(quantized, case, shared=False)
    assert torch.equal(shared[0], two[0]) and torch.equal(shared[1], two[1])
    for name, ref in two[2].items():
        assert (shared[2][name] - ref).abs().max() <= 1e-5 * ref.abs().max(), name


def test_a_shared_prompt_forward_under_checkpointing_is_the_plain_one(model):
    """Gradient checkpointing recomputes each layer of the one pass in backward, the cache's
    prompt keys with it: the same values and gradients as without."""
    from qarl.model.decoder import checkpointed_layers

    case = _shared_case(model, seed=6)
    plain = _both_forms(model, case, shared=True)
    with checkpointed_layers(model, contextlib.nullcontext):
        again = _both_forms(model, case, shared=True)
    assert torch.equal(plain[0], again[0]) and torch.equal(plain[1], again[1])
    for name, ref in plain[2].items():
        assert torch.equal(again[2][name], ref), name


def test_a_shared_prompt_forward_of_a_moe_model_is_refused():
    config = ModelConfig(
        family="qwen3_moe", vocab_size=101, hidden_size=32, intermediate_size=48, num_layers=1,
        num_heads=2, num_kv_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, tie_word_embeddings=False)
    moe = init_tiny(config, seed=0)
    case = _shared_case(moe)
    with pytest.raises(ValueError, match="shared-prompt forward needs a dense model"):
        moe.forward_shared(*case[:3], *case[4:7], case[7], SharedPrefixCache(case[3]))
