"""CUDA paths (skipped without a GPU; never run on the CPU development machine)."""

from __future__ import annotations

import pytest
import torch

from qarl.quant import SCHEMES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_cuda_linear_close_to_cpu(name):
    """Every scheme runs on CUDA and agrees with the CPU path up to kernel rounding (relative
    1e-2: bf16 outputs of _scaled_mm / the int4 kernel keep 8 significant bits)."""
    scheme = SCHEMES[name]
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(256, 512, generator=g), torch.randn(32, 512, generator=g)
    qw = scheme.quantize(w)
    cpu = scheme.linear(x, qw)
    gpu = scheme.linear(x.cuda(), qw.to("cuda")).cpu()
    assert (gpu - cpu).abs().max() / cpu.abs().max() < 1e-2


def test_cuda_int8_is_exact():
    """torch._int_mm on CUDA gives the same bits as the CPU int8 path (both exact int32)."""
    scheme = SCHEMES["w8a8-int8"]
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(128, 256, generator=g), torch.randn(5, 256, generator=g)
    qw = scheme.quantize(w)
    assert torch.equal(scheme.linear(x.cuda(), qw.to("cuda")).cpu(), scheme.linear(x, qw))


@pytest.mark.parametrize("name", ["w8a8-int8", "w8a8-fp8"])
def test_cuda_engine_scores_exactly_what_it_sampled(name):
    """On CUDA too, replaying the engine's decode path (`score`, what the learner uses for
    old_logp) reproduces the sampler's logprobs bit for bit for a quantized model."""
    from qarl.model import CausalLM, ModelConfig
    from qarl.quant import quantize_model
    from qarl.rollout import LocalEngine
    from qarl.types import SamplingParams

    torch.manual_seed(0)
    config = ModelConfig(family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_layers=2, num_heads=4, num_kv_heads=2, max_position_embeddings=128)
    model = quantize_model(CausalLM(config).cuda(), name, mode="kernel")
    engine = LocalEngine(model, eos_token_ids=())
    sampling = SamplingParams(max_new_tokens=8)
    batch = engine.generate([[5, 17, 3], [7, 8, 9, 10]], sampling, seed=0)
    assert torch.equal(engine.score(batch, sampling), batch.rollout_logp)


def test_cuda_backward_on_codes_equals_the_cpu_products():
    """train.quant_backward = 'codes' on CUDA: dL/dx by torch._int_mm (cuBLASLt) on g's int8
    rows and the weight codes equals the CPU's bits (both exact int32 sums, the same
    quantizer and the same one scaling); dL/dW, a bf16 GEMM of g s_x with the int8 activation
    codes, within bf16 rounding of g (2^-9 relative per element; bound 1e-2 of the CPU's
    largest entry, summation orders differ)."""
    from qarl.quant import numerics as nm

    scheme = SCHEMES["w8a8-int8"]
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(96, 256, generator=gen), torch.randn(40, 256, generator=gen)
    g = torch.randn(40, 96, generator=gen)
    qw, codes_pass = scheme.quantize(w), scheme.codes_pass()
    cpu_x = codes_pass.grad_input(g, qw)
    gpu_x = codes_pass.grad_input(g.cuda(), qw.to("cuda")).cpu()
    assert torch.equal(gpu_x, cpu_x)
    codes = nm.int8_rows(x)
    cpu_w = codes_pass.grad_weight(g, codes)
    gpu_w = codes_pass.grad_weight(g.cuda(), tuple(c.cuda() for c in codes)).cpu()
    assert (gpu_w - cpu_w).abs().max() <= 1e-2 * cpu_w.abs().max()
