"""oneDNN-prepacked linears: same products up to rounding, restored modules, never stale."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qarl.rollout import LocalEngine
from qarl.rollout.prepack import LinearPrepacker, prepack_available
from qarl.types import SamplingParams

pytestmark = pytest.mark.skipif(
    not prepack_available(torch.device("cpu")), reason="torch built without oneDNN"
)
PROMPTS = [[5, 17, 3, 99, 42], [7, 8], [1, 2, 3]]


def test_packed_products_match_f_linear_and_forward_is_restored(make_model):
    """Inside the block every nn.Linear uses a packed weight and its output equals F.linear
    to fp32 rounding (1e-5 on logits of size ~10); outside it the class forward is back."""
    model = make_model()
    ids = torch.tensor(PROMPTS[:1])
    with torch.no_grad():
        plain = model.logits(ids)
        with LinearPrepacker().applied(model, batch_hint=1):
            assert all("forward" in m.__dict__ for m in model.modules() if type(m) is nn.Linear)
            packed = model.logits(ids)
    assert not any("forward" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(packed, plain, atol=1e-5, rtol=0)


def test_engine_with_and_without_prepack_agree(make_model):
    """Greedy tokens are the same with prepacked and plain linears; logprobs within 1e-5."""
    model = make_model()
    greedy = SamplingParams(max_new_tokens=10, greedy=True)
    fast = LocalEngine(model, eos_token_ids=()).generate(PROMPTS, greedy, seed=0)
    plain = LocalEngine(model, eos_token_ids=(), prepack_weights=False).generate(PROMPTS, greedy, seed=0)
    assert torch.equal(fast.response_ids, plain.response_ids)
    torch.testing.assert_close(fast.rollout_logp, plain.rollout_logp, atol=1e-5, rtol=0)


def test_in_place_weight_update_is_never_served_stale(make_model):
    """After an in-place update of the weights (what load_weights and optimizer steps do), the
    engine generates with the new weights: same output as a fresh engine."""
    model, donor = make_model(seed=0), make_model(seed=1)
    engine = LocalEngine(model, eos_token_ids=())
    greedy = SamplingParams(max_new_tokens=10, greedy=True)
    before = engine.generate(PROMPTS, greedy, seed=0)
    with torch.no_grad():
        for name, tensor in donor.state_dict().items():
            model.state_dict()[name].copy_(tensor)
    after = engine.generate(PROMPTS, greedy, seed=0)
    fresh = LocalEngine(donor, eos_token_ids=()).generate(PROMPTS, greedy, seed=0)
    assert not torch.equal(before.response_ids, after.response_ids)
    assert torch.equal(after.response_ids, fresh.response_ids)
    assert torch.equal(after.rollout_logp, fresh.rollout_logp)


def test_only_plain_fp32_linears_are_packed(make_model):
    """bf16 layers and nn.Linear subclasses (e.g. quantized layers) keep their own forward."""

    class Custom(nn.Linear):
        pass

    model = make_model()
    model.lm_head.__class__ = Custom
    with LinearPrepacker().applied(model, batch_hint=1):
        assert "forward" not in model.lm_head.__dict__
        assert "forward" in model.model.layers[0].mlp.up_proj.__dict__
    bf16 = make_model(dtype=torch.bfloat16)
    with LinearPrepacker().applied(bf16, batch_hint=1):
        assert not any("forward" in m.__dict__ for m in bf16.modules())
