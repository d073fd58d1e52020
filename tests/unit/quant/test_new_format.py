"""A new format is one Scheme subclass plus register_scheme: nothing else in qarl changes.

The toy format below is defined here, in the test, and runs end to end through the public API
only: quantize_model (kernel and fake modes), export_state / load_state, describe, and
LocalEngine.generate / score on the zoo's tiny model (the fused and one-call native decode
paths included, through `row_separable` and `native_operand`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

import qarl
from qarl import native
from qarl.quant import (
    SCHEMES, QWeight, Scheme, describe, export_state, load_state, make_scheme, quant_layers,
    register_scheme, unregister_scheme,
)


@dataclass(frozen=True)
class Int8WeightOnly(Scheme):
    """Toy W8A32: int8 weights per output channel, s = max|w| / 127 (1 for a zero row); fp32
    activations, unquantized. QWeight: codes [N, K] int8; scales [N] float32."""

    name = "w8a32-toy"
    row_separable = True  # per-channel scales: q/k/v (gate/up) rows stack exactly

    def quantize(self, w: Tensor) -> QWeight:
        self.check_weight(w)
        amax = w.detach().float().abs().amax(dim=1)  # [N]
        scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        # q = clamp(round_half_even(w / s), -127, 127)
        codes = torch.round(w.detach().float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return QWeight(self.name, tuple(w.shape), codes, scales)

    def dequantize(self, qw: QWeight) -> Tensor:  # [N, K] float32
        return qw.codes.float() * qw.scales[:, None]

    def act_qdq(self, x: Tensor) -> Tensor:
        return x.float()

    def matmul(self, x: Tensor, qw: QWeight) -> Tensor:  # [M, K] -> [M, N] float32
        return self.float_gemm(x.float(), qw, lambda: self.dequantize(qw))

    def native_operand(self, qw: QWeight, device: torch.device):
        if not self.native_f32_ok(device, qw):
            return None
        return native.GemmKind.F32, self.native_f32(qw, device, lambda: self.dequantize(qw))

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        return f"{self.float_gemm_path(device, qw)} on the dequantized int8 weight"


@pytest.fixture
def toy():
    scheme = register_scheme(Int8WeightOnly())
    yield scheme
    unregister_scheme(scheme.name)


def _model(tiny_dir, shift: float):
    """The tiny model with its weights moved by `shift` * N(0, 1) (0: as saved)."""
    model = qarl.load_model(tiny_dir)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(shift * torch.randn(p.shape, generator=g))
    return model


def test_a_registered_format_runs_end_to_end(toy, tiny_dir):
    """A format defined outside the package: the learner (kernel mode) exports QWeights that
    the engine installs as-is; the engine's sampler logprobs are reproduced bit for bit by
    its own score() and by the learner's score() (the aligned old_logp); fake mode quantizes
    identically and trains, its logits within fp32 summation-order rounding of kernel mode."""
    learner = qarl.quantize_model(_model(tiny_dir, 0.01), toy.name, mode="kernel")
    engine_model = qarl.quantize_model(_model(tiny_dir, 0.0), toy.name, mode="kernel")
    assert make_scheme(toy.name) is toy and all(
        path.startswith(f"{toy.name}/kernel: ") for path in describe(learner).values())

    state = export_state(learner)
    load_state(engine_model, state)
    assert all(layer.quantize_count == 0 for layer in quant_layers(engine_model).values())

    tok = qarl.load_tokenizer(tiny_dir)
    prompts = [tok.encode(text) for text in ("12+7=", "3+4=", "the sum of 5 and 8 is")]
    sampling = qarl.SamplingParams(max_new_tokens=12, temperature=1.0)
    engine = qarl.LocalEngine(engine_model)
    batch = engine.generate(prompts, sampling, seed=0)
    assert batch.response_mask.sum() > len(prompts)
    assert torch.equal(engine.score(batch, sampling), batch.rollout_logp)
    assert torch.equal(qarl.LocalEngine(learner).score(batch, sampling), batch.rollout_logp)

    fake = qarl.quantize_model(_model(tiny_dir, 0.01), toy.name, mode="fake")
    for key, value in export_state(fake).items():
        if isinstance(value, QWeight):
            assert torch.equal(value.codes, state[key].codes), key
            assert torch.equal(value.scales, state[key].scales), key
    ids = batch.prompt_ids[:, -3:]
    with torch.no_grad():
        # fp32 sums of ~100-1000 terms in another order: ~1e-6 relative per layer
        torch.testing.assert_close(fake.logits(ids), learner.logits(ids), rtol=0, atol=1e-4)
    fake.logits(ids).logsumexp(-1).sum().backward()
    assert all(layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
               for layer in quant_layers(fake).values())


def test_unregistered_format_is_gone_and_bad_registrations_raise(toy):
    """unregister_scheme removes the name (make_scheme then lists the valid ones); a
    duplicate name, a class missing a required method, or a non-Scheme is refused clearly."""
    with pytest.raises(ValueError, match="already registered"):
        register_scheme(Int8WeightOnly())

    @dataclass(frozen=True)
    class NoKernel(Scheme):
        name = "no-kernel"

        def quantize(self, w):
            return QWeight(self.name, tuple(w.shape), w)

    with pytest.raises(TypeError, match="missing.*dequantize"):
        register_scheme(NoKernel())
    with pytest.raises(TypeError, match="Scheme instance"):
        register_scheme(Int8WeightOnly)
    assert unregister_scheme(toy.name) is toy and toy.name not in SCHEMES
    with pytest.raises(KeyError, match="w8a8-int8"):
        make_scheme(toy.name)
    register_scheme(toy)  # for the fixture's unregister
