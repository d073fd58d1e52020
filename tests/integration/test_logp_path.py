"""train.logp_path = 'forward': a naive / fake learner's logp values by its teacher-forced
forward (`qarl.train.learner.logprobs.ForwardScorer`) instead of the decode-path replay."""

from __future__ import annotations

import copy

import pytest
import torch

from safetensors.torch import load_file

from qarl.config import ConfigError, load_config
from qarl.quant import SCHEMES
from qarl.rollout import LocalEngine
from qarl.train.learner.embedding import rows_into_gradient
from qarl.train.learner.logprobs import ForwardScorer, response_logprobs
from qarl.train.phases import Experience
from qarl.train.budgets import FLOOR
from qarl.train.data import sampling_params
from qarl.train.folder import open_run
from qarl.train.sft import warm_start
from qarl.train import train
from qarl.train.checkpoint import latest
from qarl.train.learner import AlignedLearner, Passes, Precision
from qarl.train.trainer import rl_step
from qarl.train.learner.update import SOLO, update_policy
from rank_weights import assert_weights_agree


def _config(tmp_path, **extra):
    """tiny with forward logp; the fp32 gradient pass these tests reason about, pinned ('auto'
    is bf16 on CPUs with AMX-BF16); the tests that need a bf16 pass set it themselves."""
    return load_config("tiny", {"run.output_dir": str(tmp_path), "log.progress": False,
                                "rollout.batch_size": 8, "rollout.group_size": 4,
                                "train.micro_batch_size": 4, "quant.align": "fake",
                                "train.logp_path": "forward", "train.compute_dtype": "float32",
                                **extra})


def _batch(policy, data, config):
    examples = data.task.examples("train", 2, 0)
    prompts = [ids for ids in data.prompts.encode_prompts(examples) for _ in range(4)]
    sampling = sampling_params(config.rollout)
    return policy.engine.generate(prompts, sampling, seed=3), sampling


QUANTIZED = [name for name, scheme in SCHEMES.items() if not scheme.is_identity]


@pytest.mark.parametrize("align, scheme", [("naive", "w8a8-int8")]
                         + [("fake", name) for name in QUANTIZED])
def test_forward_values_are_the_gradient_pass_values(tmp_path, align, scheme):
    """The learner's replay is a ForwardScorer: its values are those the fp32 gradient pass
    computes on each micro-batch (so at the first optimizer step logp's value and the function
    its gradient comes from agree to the bit, and a later step may read its own forward's:
    `ForwardScorer.is_gradient_pass`), for every format, the same on every call, and within a
    few rounding steps of the decode path's: a naive learner, with no activation quantizer,
    within fp32 summation order (measured <= 1e-6 nats); a fake one's activation quantizer
    (int8 / fp8 per token, or the bf16 rounding of the W4A16 formats) can turn a last-bit
    difference into a whole rounding step on some row."""
    config = _config(tmp_path, **{"quant.align": align, "quant.scheme": scheme})
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        assert isinstance(policy.learner.passes.replayer, ForwardScorer)
        batch, sampling = _batch(policy, data, config)
        values, routing = policy.learner.replay(batch, sampling)
        again, _ = policy.learner.replay(batch, sampling)
        model = policy.learner.model
        with policy.learner.passes.precision.fp32_pass():
            fast = torch.cat([response_logprobs(model, batch.select(torch.arange(s, s + 4)),
                                                sampling.temperature)[0] for s in (0, 4)])
        decode = LocalEngine.from_tokenizer(model, data.tokenizer).score(batch, sampling)
    mask = batch.response_mask
    assert routing is None and values.shape == mask.shape and not values.requires_grad
    assert torch.equal(values, again) and torch.equal(values, fast.detach())
    # Other shapes, other fp32 rounding. A fake learner's activation quantizer can turn such a
    # difference into a whole rounding step on some row: an int8 step of a token's largest
    # activation / 127, or a bf16 step of 2^-9 relative (W4A16), each a few 1e-4 nats of a
    # token's logp on tiny; 0.05 bounds a handful of them on one token.
    apart = float((values - decode)[mask].abs().max())
    assert apart < (1e-5 if align == "naive" else 0.05), apart  # naive: summation order only


def test_a_later_optimizer_step_takes_its_value_from_the_same_pass(tmp_path):
    """With two mini-batches, the second step's logp value comes from the pass old_logp came
    from, on that step's own rows: at unchanged weights (lr 0) it equals old_logp bit for bit,
    so the ratio is exactly 1 where the policy did not move; the decode-path replay of the
    same weights is not."""
    config = _config(tmp_path, **{"train.mini_batches": 2, "algo.loss": "tbpo"})
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        batch, sampling = _batch(policy, data, config)
        old = policy.learner.replay(batch, sampling)[0]
        exp = Experience(batch, sampling, old, torch.tensor([1.0, -1.0, 0.5, -0.5] * 2),
                         torch.ones(8, dtype=torch.bool))
        model, passes = policy.learner.model, policy.learner.passes
        seen = []

        def later(e, rows):
            seen.append((rows, passes.values(e, rows)))
            return seen[-1][1]

        passes.later = later
        train = config.train.model_copy(update={"lr": 0.0})
        metrics = update_policy(passes, [torch.optim.SGD(model.parameters(), lr=0.0)], SOLO,
                                exp, config.algo, train, step=0)
        decode = LocalEngine.from_tokenizer(model, data.tokenizer).score(batch, sampling)
    mask = batch.response_mask
    (rows, values), = seen  # one later step: the second mini-batch, rows 4-7
    assert rows == range(4, 8) and torch.equal(values[4:], old[4:])
    assert not values[:4].any()  # the forward ran on the step's own micro-batch only
    assert not torch.equal(decode[mask], old[mask])
    assert metrics["loss/clip_frac"] == 0.0 and metrics["loss/seq_ratio_max"] == 1.0


def _update(policy, exp, config, rescore: bool):
    """The weights one update at lr 1e-3 leaves on a copy of `policy`'s learner: a later step's
    logp value by its own gradient forward, or (`rescore`) by a second forward without grad."""
    model = copy.deepcopy(policy.learner.model)
    precision = policy.learner.passes.precision
    passes = Passes(model, ForwardScorer(model, config.train.micro_batch_size, precision),
                    precision, config.train)
    passes.own_values = not rescore
    train = config.train.model_copy(update={"lr": 1e-3})
    update_policy(passes, [torch.optim.AdamW(model.parameters(), lr=1e-3)], SOLO, exp,
                  config.algo, train, step=0)
    return model.state_dict()


def _passes(learner, train, quant):
    """`learner`'s passes as a learner of `train` would hold them (same model and scorer)."""
    return Passes(learner.model, learner.passes.replayer, Precision.of(train, quant), train)


def test_a_later_step_reading_its_own_forward_is_the_same_update(tmp_path, monkeypatch):
    """Where the gradient forward computes the scorer's bits, the learner's update runs no
    second forward for the second mini-batch (it reads the gradient forward's own value) and
    the weights it leaves are those of the update that ran it, to the bit; a bf16 gradient pass
    or a LoRA learner (whose forwards differ with and without grad) scores again."""
    config = _config(tmp_path, **{"train.mini_batches": 2, "algo.loss": "tbpo"})
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        learner = policy.learner
        batch, sampling = _batch(policy, data, config)
        exp = Experience(batch, sampling, learner.replay(batch, sampling)[0],
                         torch.tensor([1.0, -1.0, 0.5, -0.5] * 2), torch.ones(8, dtype=torch.bool))
        assert learner.passes.own_values
        scored = []
        monkeypatch.setattr(ForwardScorer, "score_part", lambda self, *a, **k: scored.append(1))
        learner.update(exp, config.algo, config.train, step=0)
        assert scored == []  # the second mini-batch's value came from its own forward
        monkeypatch.undo()
        own, rescored = (_update(policy, exp, config, rescore) for rescore in (False, True))
        bf16 = config.train.model_copy(update={"compute_dtype": "bfloat16"})
        assert not _passes(learner, bf16, config.quant).own_values
    assert own.keys() == rescored.keys()
    assert all(torch.equal(own[k], rescored[k]) for k in own)
    lora = _config(tmp_path, **{"lora.rank": 4, "run.name": "lora"})
    with open_run(lora, learner=copy.deepcopy(warm_start(lora))) as (_, policy, _):
        assert not policy.learner.passes.own_values


def test_a_fake_step_with_forward_values(tmp_path):
    """One rl_step of a fake learner with train.logp_path = 'forward' and two mini-batches:
    every row's old_logp comes from the forward (audit/full_replay), the mismatch against the
    sampler is measured and calibrates the run's budget (the first step measured), the second
    step is off-policy, and the weights move."""
    config = _config(tmp_path, **{"train.mini_batches": 2, "algo.loss": "tbpo"})
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        assert not policy.contract.budget.exact and policy.contract.budget.limit is None
        before = [p.detach().clone() for p in policy.learner.model.parameters()]
        metrics = rl_step(policy, data, config, step=1)
        after = list(policy.learner.model.parameters())
    assert metrics["audit/full_replay"] == 1.0 and metrics["audit/replayed_frac"] == 1.0
    assert 0.0 < metrics["mismatch/abs_diff_mean"] < 0.05
    assert metrics["contract/over_budget"] == 0.0
    assert metrics["contract/budget"] == pytest.approx(
        max(FLOOR, 4 * metrics["mismatch/abs_diff_mean"]))
    assert metrics["policy/optimizer_steps"] + metrics["policy/skipped_steps"] == 2.0
    assert any(not torch.equal(b, a) for b, a in zip(before, after))


def test_learner_ranks_take_their_values_from_the_forward_too(tmp_path):
    """Two replicated ranks and two FSDP ranks, fake alignment, forward values, 2 epochs (the
    second epoch's value computed on rank 0's whole learner and broadcast) end with the
    weights of one rank, as closely as rank_weights.py allows for the decode path."""
    def weights(ranks: int, strategy: str = "replicate"):
        name = f"ranks{ranks}-{strategy}"
        train("tiny", {"train.steps": 2, "rollout.batch_size": 16, "train.micro_batch_size": 4,
                       "eval.size": 4, "eval.full_precision": False, "algo.epochs": 2,
                       "quant.align": "fake", "train.logp_path": "forward",
                       "dist.learner_ranks": ranks, "dist.learner_strategy": strategy,
                       "run.output_dir": str(tmp_path), "run.name": name, "log.progress": False})
        return load_file(latest(tmp_path / name) / "model.safetensors")

    one = weights(1)
    assert_weights_agree(one, weights(2))
    assert_weights_agree(one, weights(2, "fsdp"))


@pytest.mark.parametrize("overrides, setting", [
    ({"quant.align": "kernel"}, "quant.align = 'kernel'"),
    ({"quant.scheme": "none"}, "quant.scheme = 'none'"),
])
def test_forward_values_are_refused_where_the_replay_is_exact(tmp_path, overrides, setting):
    with pytest.raises(ConfigError) as caught:
        _config(tmp_path, **overrides)
    message = str(caught.value)
    assert f"train.logp_path: 'forward' with {setting}" in message
    assert "keep 'decode'" in message


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_old_logp_phase_runs_the_updates_first_forward_ahead(tmp_path, monkeypatch,
                                                                 checkpointing):
    """Where the gradient forward computes the scorer's bits, the old_logp phase
    (`replay(for_update=True)`) takes the first micro-batch's old_logp from the update's own
    first gradient forward, run ahead and kept: the same old_logp bits as scoring every row,
    only the other rows scored without grad, one forward fewer in the update, and the weights
    the update leaves equal to the bit to those of the update without the head start (with the
    layers checkpointed too: the kept forward's recompute runs in backward, after the old_logp
    phase). A kept forward serves only the batch it was run on; a bf16 gradient pass scores
    every row."""
    config = _config(tmp_path, **{"train.mini_batches": 2, "algo.loss": "tbpo",
                                  "train.gradient_checkpointing": checkpointing})
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        batch, sampling = _batch(policy, data, config)
        learner = policy.learner
        model, precision = copy.deepcopy(learner.model), learner.passes.precision
        plain = AlignedLearner(Passes(model, ForwardScorer(model, config.train.micro_batch_size,
                                                           precision), precision, config.train,
                                      solo=False),
                               [torch.optim.AdamW(model.parameters(), lr=1e-3)])
        # solo=False only to keep it from reading ahead: the same embedding gradient path
        rows_into_gradient(model, learner.passes.rows_into_gradient)
        learner.optimizers = [torch.optim.AdamW(learner.model.parameters(), lr=1e-3)]
        assert learner.passes.reads_ahead and not plain.passes.reads_ahead
        scored, forwards = [], []
        score_part = ForwardScorer.score_part
        monkeypatch.setattr(ForwardScorer, "score_part", lambda self, b, s, rows, *a, **k: (
            scored.append(rows), score_part(self, b, s, rows, *a, **k))[1])
        old, routing = learner.replay(batch, sampling, for_update=True)
        assert scored == [range(4, 8)]  # rows 0-3: the update's first forward, run ahead
        reference, _ = plain.replay(batch, sampling)
        assert routing is None and not old.requires_grad and torch.equal(old, reference)
        gradient = Passes.gradient
        monkeypatch.setattr(Passes, "gradient", lambda *a, **k: (
            forwards.append(1), gradient(*a, **k))[1])
        train = config.train.model_copy(update={"lr": 1e-3})
        for who in (learner, plain):
            exp = Experience(batch, sampling, old, advantages, torch.ones(8, dtype=torch.bool))
            who.update(exp, config.algo, train, step=0)
        assert forwards == [1, 1, 1]  # 1 for the ahead learner's second step, 2 for the plain
        ahead, without = learner.model.state_dict(), plain.model.state_dict()
        assert ahead.keys() == without.keys() and all(torch.equal(ahead[k], without[k])
                                                      for k in ahead)
        # a kept forward is read only by the update of its own batch
        learner.replay(batch, sampling, for_update=True)
        assert learner.passes._ahead is not None
        other = Experience(batch.select(torch.arange(8)), sampling, old, advantages,
                           torch.ones(8, dtype=torch.bool))
        forwards.clear()
        learner.update(other, config.algo, train, step=1)
        assert forwards == [1, 1] and learner.passes._ahead is None
        scored.clear()
        bf16 = _passes(learner, config.train.model_copy(update={"compute_dtype": "bfloat16"}),
                       config.quant)
        assert not bf16.reads_ahead
        bf16.replay(batch, sampling, for_update=True)
        assert scored == [range(0, 8)] and bf16._ahead is None
