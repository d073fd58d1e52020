"""The full-precision model evaluation decodes with: the learner's master weights, shared."""

from __future__ import annotations

import pytest
import torch

from qarl.model import load_model
from qarl.quant import quantize_model
from qarl.rollout import LocalEngine
from qarl.train.evaluate import full_precision_copy
from qarl.types import SamplingParams


@pytest.mark.parametrize("mode", ["kernel", "fake"])
def test_the_copy_shares_the_masters_and_decodes_as_a_loaded_plain_model(tiny_dir, mode):
    """Every parameter of the copy is the learner's master tensor itself (same storage, no
    0.5 GB duplicate at the final evaluation), the tied head is the copy's own embedding,
    the learner's parameters still train (requires_grad) and keep their values after the
    copy decodes, and the copy generates exactly what a plain model loaded from the same
    weights generates."""
    learner = load_model(tiny_dir)
    plain = load_model(tiny_dir)  # the reference: the unquantized model, its own storage
    quantize_model(learner, "w8a8-int8", mode=mode)
    with torch.no_grad():  # masters that differ from the loaded ones: the copy must read them
        for p, q in zip(learner.parameters(), plain.parameters()):
            p.add_(0.01 * torch.randn_like(p))
            q.copy_(p)
    before = {n: p.detach().clone() for n, p in learner.named_parameters()}

    copy = full_precision_copy(learner)

    masters = dict(learner.named_parameters())
    for name, p in copy.named_parameters():
        assert p.data_ptr() == masters[name].data_ptr(), name
        assert not p.requires_grad
    assert learner.config.tie_word_embeddings
    assert copy.lm_head.weight is copy.model.embed_tokens.weight
    assert all(p.requires_grad for p in learner.parameters())
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0)
    got = LocalEngine(copy).generate(prompts, sampling, seed=3)
    want = LocalEngine(plain).generate(prompts, sampling, seed=3)
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.rollout_logp, want.rollout_logp)
    for name, p in learner.named_parameters():
        assert torch.equal(p.detach(), before[name]), name
