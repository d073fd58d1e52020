"""`rl_step` on `tiny-moe` with routing replay: the MoE policy pair stays exactly aligned."""

from __future__ import annotations

import torch

from qarl.config import load_config
from qarl.train.folder import open_run
from qarl.train.trainer import rl_step


def test_moe_step_with_routing_replay_is_exact(tmp_path):
    """One step of tiny-moe (w8a8-int8 experts, kernel alignment, routing replay): old_logp
    equals the sampler's logprobs bit for bit, the learner's routers choose the engine's
    experts at every response token (disagreement exactly 0)."""
    config = load_config("tiny", {
        "run.output_dir": str(tmp_path), "log.progress": False, "model.name": "tiny-moe",
        "quant.routing_replay": True, "rollout.batch_size": 8, "train.micro_batch_size": 4,
    })
    with open_run(config) as (_, policy, data):
        metrics = rl_step(policy, data, config, step=0)
    assert metrics["mismatch/abs_diff_max"] == 0.0
    assert metrics["mismatch/routing_disagree_frac"] == 0.0


def test_moe_lora_steps_train_expert_adapters_and_stay_exact(tmp_path):
    """Two steps of tiny-moe with LoRA on every projection, experts included (routing
    replay): old_logp equals the sampler's logprobs bit for bit at both steps, the routers
    agree, the second sync sends adapters only, and the experts' adapters get gradients (a
    backward of the learner's logits: tiny-moe's rewards here are all 0, no RL signal)."""
    config = load_config("tiny", {
        "run.output_dir": str(tmp_path), "log.progress": False, "model.name": "tiny-moe",
        "quant.routing_replay": True, "rollout.batch_size": 8, "train.micro_batch_size": 4,
        "lora.rank": 4,
    })
    with open_run(config) as (_, policy, data):
        policy.sync.push()
        learner = policy.learner.model
        steps = [rl_step(policy, data, config, step=s) for s in range(2)]
        learner.logits(torch.tensor([[5, 6, 7, 8, 9, 10]])).logsumexp(-1).sum().backward()
        grads = {n: p.grad for n, p in learner.named_parameters() if p.grad is not None}
    assert [m["mismatch/abs_diff_max"] for m in steps] == [0.0, 0.0]
    assert [m["mismatch/routing_disagree_frac"] for m in steps] == [0.0, 0.0]
    assert all(n.endswith(("lora_A", "lora_B")) for n in grads)
    assert any(".mlp.experts." in n and float(g.abs().max()) > 0 for n, g in grads.items()
               if n.endswith("lora_B"))
    whole = sum(t.numel() * t.element_size() for t in learner.state_dict().values()) / 2**20
    assert steps[1]["sync/megabytes"] < whole / 10
