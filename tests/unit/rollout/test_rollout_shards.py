"""Generating a batch in shards: what `qarl.parallel.RayEngines` relies on, checked in-process."""

from __future__ import annotations

import pytest
import torch

from qarl.rollout import LocalEngine
from qarl.types import SamplingParams, concat_batches

PROMPTS = [[1, 5, 9], [3, 4], [7, 7, 7, 2, 6], [8], [2, 9, 4, 4], [6, 1], [5, 5, 5], [9]]


@pytest.fixture
def engine(make_model):
    return LocalEngine(make_model(), eos_token_ids=(3,))


@pytest.mark.parametrize("cut", [1, 3, 4, 7])
def test_shards_with_row_offsets_join_to_the_whole_batch(engine, cut):
    """Two shards generated with their first row as row_offset and the whole batch's prompt
    width, joined with concat_batches, are torch.equal to the whole batch in every field:
    each response's random stream follows its row, not its batch position."""
    sampling = SamplingParams(max_new_tokens=6, temperature=1.3)
    whole = engine.generate(PROMPTS, sampling, seed=11)
    width = max(len(p) for p in PROMPTS)
    parts = [engine.generate(PROMPTS[:cut], sampling, seed=11, prompt_width=width),
             engine.generate(PROMPTS[cut:], sampling, seed=11, row_offset=cut, prompt_width=width)]
    joined = concat_batches(parts, engine.pad_token_id)
    for field in ["prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logp"]:
        assert torch.equal(getattr(whole, field), getattr(joined, field)), field
    assert whole.finish_reasons == joined.finish_reasons


def test_row_offset_moves_the_streams(engine):
    """The same prompts at another row_offset draw other tokens (the offset is not ignored)."""
    sampling = SamplingParams(max_new_tokens=6, temperature=1.3)
    a = engine.generate(PROMPTS, sampling, seed=11)
    b = engine.generate(PROMPTS, sampling, seed=11, row_offset=8)
    assert not torch.equal(a.response_ids, b.response_ids)


def test_shard_bounds_cover_the_rows_in_order():
    """shard_bounds: contiguous, in order, sizes within one of each other, never empty."""
    pytest.importorskip("ray")
    from qarl.parallel import shard_bounds

    assert shard_bounds(64, 2) == [(0, 32), (32, 64)]
    assert shard_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert shard_bounds(2, 4) == [(0, 1), (1, 2)]


def test_moe_shards_join_with_the_experts_each_token_used(make_model):
    """A Qwen3-MoE model: shards generated as RayEngines does (row offsets, the batch's prompt
    width) join into routed_experts torch.equal to the whole batch's, so routing replay and
    the routing-disagreement metric see the same experts with rollout workers as without.
    Shards of other prompt widths are padded with -1 around their own experts."""
    model = make_model(family="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, num_layers=2)
    engine = LocalEngine(model, eos_token_ids=(9,))  # row 1 stops after one token (seed 5)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.3)
    whole = engine.generate(PROMPTS, sampling, seed=5)
    width = max(len(p) for p in PROMPTS)
    parts = [engine.generate(PROMPTS[a:b], sampling, seed=5, row_offset=a, prompt_width=width)
             for a, b in [(0, 1), (1, 2), (2, 8)]]
    assert parts[1].response_ids.shape[1] < parts[2].response_ids.shape[1]  # right padding used
    joined = concat_batches(parts, engine.pad_token_id)
    assert whole.routed_experts is not None
    assert torch.equal(joined.routed_experts, whole.routed_experts)

    narrow = engine.generate(PROMPTS[:2], sampling, seed=5)  # prompt width 3, not 5
    joined = concat_batches([narrow, whole], engine.pad_token_id)
    p, n = narrow.prompt_ids.shape[1], narrow.response_ids.shape[1]
    P = whole.prompt_ids.shape[1]
    assert torch.equal(joined.routed_experts[:2, P - p: P + n], narrow.routed_experts)
    outside = torch.cat([joined.routed_experts[:2, : P - p], joined.routed_experts[:2, P + n:]], 1)
    assert bool((outside == -1).all())
    with pytest.raises(ValueError, match="some batches have routed_experts"):
        concat_batches([parts[0], LocalEngine(make_model(), eos_token_ids=(3,)).generate(
            PROMPTS[:1], sampling, seed=5)], engine.pad_token_id)
