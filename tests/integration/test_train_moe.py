"""`rl_step` on `tiny-moe` with routing replay: the MoE policy pair stays exactly aligned."""

from __future__ import annotations

from qarl.config import load_config
from qarl.train.setup import open_run
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
