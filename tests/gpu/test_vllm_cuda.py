"""VLLMEngine and compressed-tensors exports on vLLM's CUDA kernels (FP8, int4, NVFP4).

Skipped without CUDA and the `vllm` package (CUDA build, installed into qarl's environment as
qarl/rollout/README.md says). On CUDA the models are bf16: vLLM's FP8 / Marlin int4 / NVFP4
kernels take half-precision activations. The CPU development machine cannot run this file;
the bounds below are reasoned, not measured (see each constant).
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
vllm = pytest.importorskip("vllm")

from qarl.rollout.vllm_support import VLLM_CUDA_SCHEMES  # noqa: E402
from qarl.model import load_model, load_tokenizer  # noqa: E402
from qarl.quant import export_state, quantize_model  # noqa: E402
from qarl.rollout import LocalEngine  # noqa: E402
from qarl.rollout.vllm_engine import VLLMEngine  # noqa: E402
from qarl.types import SamplingParams  # noqa: E402

MODEL = "smollm2-135m"
SCHEMES = [s for s in VLLM_CUDA_SCHEMES if s != "none"]
SUMS = [(3, 4), (5, 2), (7, 8), (1, 9)]
# bf16 activations keep 8 significant bits, so vLLM's bf16 kernels and qarl's fake forward
# (the same codes, qarl's arithmetic in bf16 on the CPU) differ by bf16 rounding compounded
# over 30 layers. On CUDA vLLM's GEMMs are exact (no CPU int16 saturation, vllm_engine.py),
# so the floor is SmolLM2's own sensitivity, as between qarl's exact int8 engine and its fake
# learner in fp32: 0.21-0.25 mean, up to 1.47 max (5 seeds); the bounds leave room over it.
MEAN_BOUND, MAX_BOUND = 0.4, 2.5


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.apply_chat(f"What is {a} + {b}?", tokenize=True) for a, b in SUMS]


@pytest.fixture(scope="module", params=SCHEMES)
def served(request, tokenizer, tmp_path_factory):
    """(scheme, VLLMEngine on the kernel-quantized bf16 model, fake-quant learner scorer)."""
    base = load_model(MODEL, dtype=torch.bfloat16)
    learner = quantize_model(copy.deepcopy(base), request.param, mode="fake")
    engine_model = quantize_model(copy.deepcopy(base), request.param, mode="kernel")
    folder = tmp_path_factory.mktemp(f"vllm-cuda-{request.param}")
    engine = VLLMEngine.from_tokenizer(engine_model, tokenizer, folder, max_context=512)
    yield request.param, engine, LocalEngine.from_tokenizer(learner, tokenizer)
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def _abs_diff(a, b, mask) -> tuple[float, float]:
    d = (a.float() - b.float()).abs()[mask]
    return float(d.mean()), float(d.max())


def test_cuda_vllm_logprobs_close_to_the_fake_learner(served, prompts):
    """Per CUDA scheme: vLLM's sampler logprobs on qarl's codes are within the bound of the
    fake-quant learner's replay of the same tokens (the `fake` alignment with vLLM)."""
    scheme, engine, fake = served
    sampling = SamplingParams(max_new_tokens=16)
    batch = engine.generate(prompts, sampling, seed=0)
    mean, worst = _abs_diff(batch.rollout_logp, fake.score(batch, sampling), batch.response_mask)
    assert mean < MEAN_BOUND and worst < MAX_BOUND, (scheme, mean, worst)


def test_cuda_vllm_load_weights_follows_new_codes(served, prompts):
    """Per CUDA scheme: after load_weights with every down_proj negated, vLLM's logprobs of
    its own new tokens are far (> 4x the bound's mean) from what the old weights give, and
    close to the fake learner given the same new state."""
    scheme, engine, fake = served
    sampling = SamplingParams(max_new_tokens=12)
    original = export_state(fake.model)
    changed = {name: (-value if "down_proj.weight" in name and isinstance(value, torch.Tensor)
                      else value) for name, value in original.items()}
    for name, value in original.items():
        if "down_proj.weight" in name and not isinstance(value, torch.Tensor):
            changed[name] = type(value)(value.scheme, value.shape, -value.codes, value.scales)
    old = engine.generate(prompts, sampling, seed=1)
    engine.load_weights(changed)
    fake.load_weights(changed)
    try:
        after = engine.generate(prompts, sampling, seed=1)
        new_mean, _ = _abs_diff(after.rollout_logp, fake.score(after, sampling), after.response_mask)
    finally:
        engine.load_weights(original)
        fake.load_weights(original)
    old_mean, _ = _abs_diff(after.rollout_logp, fake.score(after, sampling), after.response_mask)
    assert engine.last_sync_seconds > 0
    assert new_mean < MEAN_BOUND and old_mean > 4 * new_mean, (scheme, new_mean, old_mean)
    assert not torch.equal(old.response_ids, after.response_ids)


def test_cuda_exported_folder_serves_the_engines_greedy_tokens(served, prompts):
    """Per CUDA scheme: the compressed-tensors folder the engine serves (written by the same
    exporter as `qarl export`) loaded by a fresh vllm.LLM gives the engine's greedy tokens:
    the same codes on the same kernels."""
    scheme, engine, _ = served
    sampling = SamplingParams(max_new_tokens=16, greedy=True)
    ours = engine.generate(prompts, sampling, seed=0)
    llm = vllm.LLM(model=str(engine.folder), skip_tokenizer_init=True, enforce_eager=True,
                   dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.2)
    theirs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                          vllm.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    del llm
    gc.collect()
    for i, result in enumerate(theirs):
        n = int(ours.response_lengths[i])
        assert list(result.outputs[0].token_ids)[:n] == ours.response_ids[i, :n].tolist(), scheme
