"""The RL trainer: `rl_step` is one step, `train` the loop around it. Read it top to bottom.

One step (`rl_step`, the phase table of docs/training.md): prompts -> the engine samples G
responses per prompt with the quantized weights -> rewards (worker processes, deadlines) ->
group advantages -> old_logp from the aligned learner (the engine's own decode path replayed
with the sampled tokens: exact on CPU) -> K epochs of micro-batched updates with the
configured loss and rollout correction -> the master weights are quantized once and pushed to
the engine. The loop (`train`) adds resume, evaluation, logging and checkpoints.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from qarl.config import RunConfig, load_config
from qarl.train import checkpoint
from qarl.train.evaluate import evaluate
from qarl.train.metrics import MetricsLogger
from qarl.train.optim import build_optimizer
from qarl.train.phases import (
    Experience, PhaseTimer, compute_advantages, reward_metrics, sample_metrics, score_responses,
    train_examples, update_policy,
)
from qarl.train.setup import Data, Policy, open_run, sampling_params
from qarl.train.sft import warm_start
from qarl.train.summary import finish_run


def rl_step(policy: Policy, data: Data, optimizers: list[torch.optim.Optimizer],
            config: RunConfig, step: int) -> dict[str, float]:
    """One RL step (0-based `step`): sample, score, update the learner, push it to the engine.
    Returns the step's metrics (docs/training.md, "What a run logs")."""
    timer = PhaseTimer()
    G, seed = config.rollout.group_size, config.run.seed
    sampling = sampling_params(config.rollout)
    examples = train_examples(data.task, seed, step, config.rollout.batch_size // G)
    prompt_ids = [ids for ids in data.prompts.encode_prompts(examples) for _ in range(G)]
    with timer("generate"):
        batch = policy.engine.generate(prompt_ids, sampling, seed=seed * 100_003 + step)
    with timer("reward"):
        scored, completions = score_responses(data, examples, batch, G)
    advantages, rows, group_metrics = compute_advantages(scored.rewards, batch, config.algo, G)
    with timer("old_logp"):
        old_logp = policy.replay(batch, sampling)
    exp = Experience(batch, sampling, old_logp, advantages, rows)
    with timer("update"):
        update = update_policy(policy, optimizers, exp, config.algo, config.train, step)
    with timer("sync"):
        sync = policy.sync.push()
    generated = int(batch.response_mask.sum())
    return {
        **reward_metrics(scored), **group_metrics, **update, **sync,
        **sample_metrics(data.task, exp, completions),
        **timer.metrics(),
        "response/length_mean": generated / batch.num_sequences,
        "speed/tokens_per_s": generated / max(1e-9, timer.seconds["generate"]),
    }


def train(recipe: str | Path | Mapping | RunConfig | None = None,
          overrides: Mapping[str, Any] | Sequence[str] | None = None) -> dict[str, Any]:
    """Run RL training; return the summary (also written to run_dir/summary.json)."""
    config = load_config(recipe, overrides)  # every problem reported before any work starts
    with open_run(config, learner=warm_start(config)) as (folder, policy, data):
        run_dir, steps = folder.path, config.train.steps
        optimizers = build_optimizer(policy.learner, config.train.optimizer, config.train.lr,
                                     config.train.weight_decay, tuple(config.train.betas))
        start_step = 0
        resumed = checkpoint.latest(run_dir) if config.run.resume else None
        if resumed is not None:
            start_step = checkpoint.load(resumed, policy.learner, optimizers)["step"]
        else:
            checkpoint.clear(run_dir)  # starting over: an old run's checkpoints must not linger
        policy.sync.push()  # the engine decodes with the learner's current (possibly resumed) codes
        log = MetricsLogger(run_dir, steps, progress=config.log.progress,
                            tensorboard=config.log.tensorboard, jsonl=config.log.jsonl,
                            start_step=start_step)
        if resumed is not None:
            log.write(f"resumed from {resumed} at step {start_step}")
        before = evaluate(policy, data, config) if start_step == 0 else None
        if before is not None:
            log.log(0, before, kind="eval")

        for step in range(start_step, steps):
            log.log(step + 1, rl_step(policy, data, optimizers, config, step))
            every = config.train.checkpoint_every
            if (every and (step + 1) % every == 0) or step + 1 == steps:
                checkpoint.save(run_dir, step + 1, policy.learner, optimizers,
                                {"time": time.time()}, keep=config.train.keep_checkpoints)
            if config.eval.every and (step + 1) % config.eval.every == 0 and step + 1 < steps:
                log.log(step + 1, evaluate(policy, data, config), kind="eval")

        after = evaluate(policy, data, config)
        log.log(steps, after, kind="eval")
        log.close()
        summary = finish_run(run_dir, config.log, before, after)
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        return summary
