"""LocalEngine.generate: layout, logprobs vs a teacher-forced forward, stopping, seeds, errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qarl.rollout import LocalEngine, token_logprobs
from qarl.types import FINISH_LENGTH, FINISH_STOP, RolloutBatch, SamplingParams

PROMPTS = [[5, 17, 3, 99, 42], [7, 8], [1, 2, 3], [64, 1, 100, 4, 5, 6, 9]]
GREEDY = SamplingParams(max_new_tokens=12, greedy=True)


def teacher_forced_logp(model, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """[N, L] float32: logprob of each response token from one full-sequence forward."""
    ids, mask = batch.sequence_ids(), batch.sequence_mask()  # [N, P + L]
    positions = (mask.long().cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        hidden = model(ids, positions=positions, key_mask=mask)
        P = batch.prompt_ids.shape[1]
        logits = model.lm_head(hidden[:, P - 1 : -1])  # [N, L, V]: position P-1+t predicts t
    return token_logprobs(logits, batch.response_ids, temperature) * batch.response_mask


def test_batch_layout_and_prompt_padding(make_model):
    """Prompts come back left-padded with their mask; the response block has one column per
    step and a row of length max_new_tokens with no stop ids finishes with "length"."""
    engine = LocalEngine(make_model(), eos_token_ids=(), pad_token_id=0)
    batch = engine.generate(PROMPTS, GREEDY, seed=0)
    assert batch.prompt_ids.shape == (4, 7) and batch.response_ids.shape == (4, 12)
    for row, prompt in enumerate(PROMPTS):
        assert batch.prompt_ids[row, 7 - len(prompt) :].tolist() == prompt
        assert batch.prompt_mask[row].tolist() == [False] * (7 - len(prompt)) + [True] * len(prompt)
        assert (batch.prompt_ids[row, : 7 - len(prompt)] == 0).all()
    assert batch.response_mask.all()
    assert batch.finish_reasons == [FINISH_LENGTH] * 4
    assert batch.rollout_logp.dtype == torch.float32 and (batch.rollout_logp <= 0).all()
    assert not any(t.is_inference() for t in (batch.response_ids, batch.response_mask, batch.rollout_logp))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logp_matches_teacher_forced_forward(make_model, temperature):
    """Sampler logprobs (cached decode, ragged left-padded prompts) equal the logprobs of the
    same tokens from one full-sequence forward within 1e-5 in fp32 (only the summation order
    of attention and matmuls differs: ~1e-6 observed)."""
    model = make_model(family="qwen3")
    engine = LocalEngine(model, eos_token_ids=())
    batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, temperature=temperature), seed=3)
    reference = teacher_forced_logp(model, batch, temperature)
    torch.testing.assert_close(batch.rollout_logp, reference, atol=1e-5, rtol=0)


def test_greedy_logp_matches_teacher_forced_at_temperature_one(make_model):
    """Greedy reports log_softmax of the raw logits: the teacher-forced value at T=1."""
    model = make_model(family="llama")
    batch = LocalEngine(model, eos_token_ids=()).generate(PROMPTS, GREEDY, seed=0)
    torch.testing.assert_close(batch.rollout_logp, teacher_forced_logp(model, batch, 1.0), atol=1e-5, rtol=0)


def test_same_seed_same_output_different_seed_different_tokens(make_model):
    """Generation is a function of the seed: identical batches for one seed, other tokens for
    another seed."""
    engine = LocalEngine(make_model(), eos_token_ids=())
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0)
    a, b = engine.generate(PROMPTS, sampling, seed=11), engine.generate(PROMPTS, sampling, seed=11)
    for field in ("prompt_ids", "response_ids", "response_mask", "rollout_logp"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    c = engine.generate(PROMPTS, sampling, seed=12)
    assert not torch.equal(a.response_ids, c.response_ids)


def test_ragged_batch_equals_one_at_a_time(make_model):
    """Left padding and ragged prompt lengths do not change greedy tokens: the batch equals
    each prompt generated alone."""
    engine = LocalEngine(make_model(family="qwen2"), eos_token_ids=())
    batch = engine.generate(PROMPTS, GREEDY, seed=0)
    for row, prompt in enumerate(PROMPTS):
        alone = engine.generate([prompt], GREEDY, seed=0)
        assert torch.equal(batch.response_ids[row], alone.response_ids[0]), row
        torch.testing.assert_close(batch.rollout_logp[row], alone.rollout_logp[0], atol=1e-5, rtol=0)


def test_top_k_one_equals_greedy(make_model):
    """Sampling with top_k=1 produces the greedy tokens."""
    engine = LocalEngine(make_model(), eos_token_ids=())
    greedy = engine.generate(PROMPTS, GREEDY, seed=0)
    top1 = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12, top_k=1), seed=5)
    assert torch.equal(top1.response_ids, greedy.response_ids)


def test_eos_stops_a_row_and_other_rows_continue(make_model):
    """A row that emits an EOS id keeps it as its last masked token, finishes with "stop", and
    is padding (pad id, mask False, logp 0) afterwards; rows without it are unchanged (the
    batch is compacted once half the rows have stopped)."""
    model = make_model()
    free = LocalEngine(model, eos_token_ids=()).generate(PROMPTS, GREEDY, seed=0)
    eos = int(free.response_ids[0, 2])
    engine = LocalEngine(model, eos_token_ids=(eos,), pad_token_id=1)
    batch = engine.generate(PROMPTS, GREEDY, seed=0)
    for row in range(4):
        tokens = free.response_ids[row].tolist()
        if eos in tokens:
            end = tokens.index(eos) + 1
            assert batch.finish_reasons[row] == FINISH_STOP
            assert batch.response_ids[row, :end].tolist() == tokens[:end]
            assert batch.response_mask[row].tolist() == [True] * end + [False] * (batch.response_mask.shape[1] - end)
            assert (batch.response_ids[row, end:] == 1).all() and (batch.rollout_logp[row, end:] == 0).all()
        else:
            assert batch.finish_reasons[row] == FINISH_LENGTH
            assert batch.response_ids[row].tolist() == tokens
    assert batch.finish_reasons[0] == FINISH_STOP and batch.response_lengths[0] == 3


def test_stop_token_ids_from_sampling_params(make_model):
    """SamplingParams.stop_token_ids stop a row like EOS; when every row stops, L is the
    longest response."""
    model = make_model()
    free = LocalEngine(model, eos_token_ids=()).generate([PROMPTS[0]], GREEDY, seed=0)
    stop = int(free.response_ids[0, 4])
    sampling = SamplingParams(max_new_tokens=12, greedy=True, stop_token_ids=(stop,))
    batch = LocalEngine(model, eos_token_ids=()).generate([PROMPTS[0]], sampling, seed=0)
    end = free.response_ids[0].tolist().index(stop) + 1
    assert batch.finish_reasons == [FINISH_STOP]
    assert batch.response_ids.shape == (1, end)


def test_context_limit_cuts_generation_with_length(make_model):
    """When prompt + max_new_tokens exceeds max_context, generation stops at the limit with
    finish reason "length"."""
    engine = LocalEngine(make_model(), eos_token_ids=(), max_context=10)
    batch = engine.generate(PROMPTS, GREEDY, seed=0)  # longest prompt: 7 tokens
    assert batch.response_ids.shape == (4, 3)
    assert batch.finish_reasons == [FINISH_LENGTH] * 4


def test_default_eos_comes_from_model_config(make_model):
    """eos_token_ids=None takes the model config's EOS ids; () means none."""
    model = make_model(eos_token_id=[3, 9])
    assert LocalEngine(model).eos_token_ids == (3, 9)
    assert LocalEngine(model, eos_token_ids=()).eos_token_ids == ()


def test_prompt_longer_than_context_raises(make_model):
    """A prompt that leaves no room in the context raises with its length, max_new_tokens and
    the limit."""
    engine = LocalEngine(make_model(), max_context=7)
    with pytest.raises(ValueError, match=r"7 tokens.*max_new_tokens=12.*context limit of 7"):
        engine.generate(PROMPTS, GREEDY, seed=0)


@pytest.mark.parametrize(
    "prompts, message",
    [
        ([], "empty prompt list"),
        ([[1, 2], []], r"prompts \[1\] are empty"),
        ([[1, 2], [3, 128]], r"prompt 1 contains token id 128 outside the model vocabulary \[0, 128\)"),
        ([[-1]], r"prompt 0 contains token id -1"),
    ],
)
def test_bad_prompts_raise(make_model, prompts, message):
    """Empty prompt lists, empty prompts and out-of-vocabulary ids raise saying which."""
    with pytest.raises(ValueError, match=message):
        LocalEngine(make_model()).generate(prompts, GREEDY, seed=0)


def test_bad_special_ids_raise(make_model):
    """EOS or pad ids outside the vocabulary are refused at construction."""
    with pytest.raises(ValueError, match=r"\[500\] are outside the model vocabulary"):
        LocalEngine(make_model(), eos_token_ids=(500,))


def test_from_tokenizer_takes_eos_and_pad(make_model):
    """from_tokenizer reads .eos_token_ids and .pad_token_id, falling back to the first EOS."""
    model = make_model()
    engine = LocalEngine.from_tokenizer(model, SimpleNamespace(eos_token_ids=[2, 7], pad_token_id=5))
    assert (engine.eos_token_ids, engine.pad_token_id) == ((2, 7), 5)
    engine = LocalEngine.from_tokenizer(model, SimpleNamespace(eos_token_ids=[2, 7], pad_token_id=None))
    assert engine.pad_token_id == 2


def test_load_weights_installs_plain_tensors(make_model):
    """load_weights (through qarl.quant.load_state) replaces the weights in place: the engine
    then generates exactly what an engine built on the donor model generates."""
    model, donor = make_model(seed=0), make_model(seed=1)
    engine = LocalEngine(model, eos_token_ids=())
    engine.load_weights({name: tensor.clone() for name, tensor in donor.state_dict().items()})
    assert engine.model is model
    got = engine.generate(PROMPTS, GREEDY, seed=0)
    want = LocalEngine(donor, eos_token_ids=()).generate(PROMPTS, GREEDY, seed=0)
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.rollout_logp, want.rollout_logp)


def test_quantized_model_generates_with_matching_logprobs(make_model):
    """A model quantized by qarl.quant (int8 kernel mode) runs in the engine and its sampler
    logprobs match its own teacher-forced forward within 1e-5 (the int8 GEMM is exact and
    batch-invariant; the fp32 attention summation order differs)."""
    from qarl.quant import quantize_model

    model = quantize_model(make_model(), "w8a8-int8", mode="kernel")
    batch = LocalEngine(model, eos_token_ids=()).generate(PROMPTS, SamplingParams(max_new_tokens=8), seed=1)
    torch.testing.assert_close(batch.rollout_logp, teacher_forced_logp(model, batch, 1.0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scheme", ["none", "w8a8-int8", "w4a16-int4", "w8a8-fp8"])
def test_shared_prompt_prefill_gives_the_bits_of_a_prefill_per_row(make_model, scheme):
    """Rows that share a prompt (groups of 3, in shuffled order, beside a prompt of its own)
    prefill once: tokens, sampler logprobs and masks equal a prefill of every row bit for
    bit, when sampling and when scoring the batch."""
    from qarl.quant import quantize_model

    model = make_model()
    if scheme != "none":
        quantize_model(model, scheme, mode="kernel", **({"group_size": 32} if "int4" in scheme else {}))
    prompts = [PROMPTS[i] for i in (0, 1, 0, 2, 1, 0, 2, 1, 2, 3)]
    sampling = SamplingParams(max_new_tokens=10)
    shared, per_row = (LocalEngine(model, eos_token_ids=(3,), share_prompts=flag)
                       for flag in (True, False))
    a, b = (engine.generate(prompts, sampling, seed=4) for engine in (shared, per_row))
    assert torch.equal(a.response_ids, b.response_ids)
    assert torch.equal(a.rollout_logp, b.rollout_logp) and torch.equal(a.response_mask, b.response_mask)
    assert torch.equal(shared.score(a, sampling), a.rollout_logp)
    assert torch.equal(per_row.score(a, sampling), a.rollout_logp)
