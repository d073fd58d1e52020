"""train.mini_batches: each part of the batch its own optimizer step, normalized over its rows."""

from __future__ import annotations

import copy

import pytest
import torch

from qarl.config import load_config
from qarl.rollout import LocalEngine
from qarl.train.phases import Experience
from qarl.train.data import sampling_params
from qarl.train.folder import open_run
from qarl.train.sft import warm_start
from qarl.train.learner import Passes
from qarl.train.learner.update import SOLO, mini_batches, update_policy


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients of every step it takes."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]
                          if p.grad is not None])
        return super().step(closure)


def test_mini_batch_rows_are_consecutive_equal_parts():
    assert mini_batches(8, 1) == [range(8)]
    assert mini_batches(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]


def _update(policy, data, exp, config, parts: int):
    model = copy.deepcopy(policy.learner.model)
    passes = Passes(model, LocalEngine.from_tokenizer(model, data.tokenizer),
                    policy.learner.passes.precision, config.train)
    optimizer = RecordingSGD(model.parameters(), lr=0.05)
    train = config.train.model_copy(update={"mini_batches": parts})
    metrics = update_policy(passes, [optimizer], SOLO, exp, config.algo, train, step=0)
    return optimizer.seen, metrics


@pytest.mark.parametrize("loss", ["grpo", "tbpo"])
def test_a_mini_batch_is_normalized_over_its_own_rows(tmp_path, loss):
    """Rows 4-7 carry no advantage. One step over all 8 rows (micro-batches of 4) averages
    the first half's loss over 8 sequences; with two mini-batches the first step averages it
    over its own 4, so its gradient is exactly twice as large (a power-of-two scale is exact
    in floating point; no gradient clipping, which would rescale), and the second step, which
    has no signal, is skipped."""
    config = load_config("tiny", {"run.output_dir": str(tmp_path), "log.progress": False,
                                  "rollout.batch_size": 8, "rollout.group_size": 4,
                                  "train.micro_batch_size": 4, "train.grad_clip": 0.0,
                                  "algo.loss": loss})
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        examples = data.task.examples("train", 2, 0)
        prompts = [ids for ids in data.prompts.encode_prompts(examples) for _ in range(4)]
        sampling = sampling_params(config.rollout)
        batch = policy.engine.generate(prompts, sampling, seed=3)
        old = policy.learner.replay(batch, sampling)[0]
        advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
        exp = Experience(batch, sampling, old, advantages, torch.ones(8, dtype=torch.bool))
        whole, whole_metrics = _update(policy, data, exp, config, 1)
        halves, half_metrics = _update(policy, data, exp, config, 2)
    assert len(whole) == len(halves) == 1  # the second half's step had no gradient
    assert half_metrics["policy/skipped_steps"] == 1 and half_metrics["policy/optimizer_steps"] == 1
    assert whole_metrics["policy/optimizer_steps"] == 1
    assert all(torch.equal(h, 2 * w) for h, w in zip(halves[0], whole[0]))
    assert any(bool(w.abs().sum() > 0) for w in whole[0])

