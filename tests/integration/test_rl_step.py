"""`rl_step` on the warm-started `tiny` model: what one step promises about the policy pair."""

from __future__ import annotations

import copy

import torch

from qarl.config import load_config
from qarl.quant import QWeight, export_state, quant_layers
from qarl.train.setup import open_run
from qarl.train.sft import warm_start
from qarl.train.trainer import rl_step

PHASES = ["generate", "reward", "old_logp", "update", "sync"]
# Step 1, not 0: its 8 samples have a reward spread (step 0's all score 0, and a step without
# signal takes no update to check).
STEP = 1


def _config(tmp_path, **extra):
    return load_config("tiny", {"run.output_dir": str(tmp_path), "log.progress": False,
                                "rollout.batch_size": 8, "train.micro_batch_size": 4, **extra})


def test_step_pushes_the_updated_learner_to_the_engine(tmp_path):
    """After one step the engine holds exactly the codes and scales of the updated learner
    (sync is the step's last phase), the update moved the learner, the sampled tokens' replay
    matched the sampler bit for bit (kernel alignment), and every phase of docs/training.md
    was timed, in order."""
    config = _config(tmp_path)
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        pushed_before = {k: v.codes.clone() for k, v in export_state(policy.learner.model).items()
                         if isinstance(v, QWeight)}
        metrics = rl_step(policy, data, config, step=STEP)
        learner_codes = export_state(policy.learner.model)
        engine_layers = quant_layers(policy.engine.model)
    assert engine_layers and set(engine_layers) == set(quant_layers(policy.learner.model))
    for name, layer in engine_layers.items():
        pushed, held = learner_codes[f"{name}.weight"].tensors(), layer.qweight().tensors()
        assert pushed.keys() == held.keys()
        assert all(torch.equal(pushed[k], held[k]) for k in held), name
    assert any(not torch.equal(pushed_before[k], learner_codes[k].codes) for k in pushed_before)
    assert metrics["mismatch/abs_diff_max"] == 0.0
    assert [k.split("/", 1)[1] for k in metrics if k.startswith("time/")] == PHASES


def test_every_exact_logp_is_one_whole_batch_replay(tmp_path):
    """With algo.epochs = 3 the learner's decode path is replayed exactly three times per
    step (old_logp, then once before each later epoch), always on the whole sampled batch,
    never per micro-batch: a replay over other shapes is not exact (docs/alignment.md)."""
    config = _config(tmp_path, **{"algo.epochs": 3})
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        replayed_rows = []
        replay = policy.learner.replay  # old_logp's replay and the update's later epochs'

        def counting_replay(batch, sampling):
            replayed_rows.append(batch.num_sequences)
            return replay(batch, sampling)

        policy.learner.replay = counting_replay
        rl_step(policy, data, config, step=STEP)
    assert replayed_rows == [config.rollout.batch_size] * 3
