"""The RL loop: read it top to bottom.

Each step: prompts -> the engine samples G responses per prompt with the quantized weights
-> rewards (worker processes, deadlines) -> group advantages -> old_logp from the aligned
learner (the engine's own decode path replayed with the sampled tokens: exact on CPU) ->
K epochs of micro-batched updates with the configured loss and rollout correction -> the
master weights are quantized once and pushed to the engine.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from qarl.algo.diagnostics import error_token_metrics, mismatch_metrics
from qarl.config import RunConfig, load_config
from qarl.train import checkpoint
from qarl.train.evaluate import evaluate
from qarl.train.learner import replay_logprobs
from qarl.train.metrics import MetricsLogger
from qarl.train.optim import build_optimizer
from qarl.train.phases import (
    PhaseTimer, compute_advantages, reward_metrics, score_responses, update_policy,
)
from qarl.train.setup import build_run
from qarl.train.sft import warm_start
from qarl.train.summary import finish_run
from qarl.train.sync import WeightSync


def train(recipe: str | Path | Mapping | RunConfig | None = None,
          overrides: Mapping[str, Any] | Sequence[str] | None = None) -> dict[str, Any]:
    """Run RL training; return the summary (also written to run_dir/summary.json)."""
    config = load_config(recipe, overrides)  # every problem reported before any work starts
    run = build_run(config, learner=warm_start(config))
    try:
        return _train(run)
    finally:
        run.close()


def _train(run) -> dict[str, Any]:
    config = run.config
    optimizers = build_optimizer(run.learner, config.train.optimizer, config.train.lr,
                                 config.train.weight_decay, tuple(config.train.betas))
    start_step = 0
    resumed = checkpoint.latest(run.run_dir) if config.run.resume else None
    if resumed is not None:
        start_step = checkpoint.load(resumed, run.learner, optimizers)["step"]
    else:
        checkpoint.clear(run.run_dir)  # starting over: an old run's checkpoints must not linger
    sync = WeightSync(run.learner, run.engine)
    sync.push()  # the engine decodes with the learner's current (possibly resumed) codes
    log = MetricsLogger(run.run_dir, config.train.steps, progress=config.log.progress,
                        tensorboard=config.log.tensorboard, jsonl=config.log.jsonl,
                        start_step=start_step)
    if resumed is not None:
        log.write(f"resumed from {resumed} at step {start_step}")
    before = evaluate(run, run.eval_examples) if start_step == 0 else None
    if before is not None:
        log.log(0, before, kind="eval")
    G = config.rollout.group_size

    for step in range(start_step, config.train.steps):
        timer = PhaseTimer()
        examples = run.train_examples(step)
        prompt_ids = [ids for ids in run.encode_prompts(examples) for _ in range(G)]
        with timer("generate"):
            batch = run.engine.generate(prompt_ids, run.sampling(), seed=config.run.seed * 100_003 + step)
        with timer("reward"):
            scored, completions = score_responses(run, examples, batch, G)
        advantages, rows, group_metrics = compute_advantages(scored.rewards, batch, config.algo, G)
        with timer("old_logp"):
            old_logp = replay_logprobs(run.scorer, batch, run.sampling())
        with timer("update"):
            update = update_policy(run, optimizers, batch, old_logp, advantages, rows, step)
        with timer("sync"):
            sync_metrics = sync.push()

        grammar = getattr(run.task, "grammar_ok", None)
        verdicts = [grammar(c) for c in completions] if grammar else None
        generated = int(batch.response_mask.sum())
        metrics = {
            **reward_metrics(scored), **group_metrics, **update, **sync_metrics,
            **{f"mismatch/{k}": v for k, v in mismatch_metrics(
                old_logp, batch.rollout_logp, batch.response_mask).items()},
            **{f"errors/{k}": v for k, v in error_token_metrics(
                batch.response_ids, batch.response_mask, batch.finish_reasons,
                learner_logp=old_logp, grammar_ok=verdicts).items()},
            **timer.metrics(),
            "response/length_mean": generated / batch.num_sequences,
            "speed/tokens_per_s": generated / max(1e-9, timer.seconds["generate"]),
        }
        log.log(step + 1, metrics)
        every = config.train.checkpoint_every
        if (every and (step + 1) % every == 0) or step + 1 == config.train.steps:
            checkpoint.save(run.run_dir, step + 1, run.learner, optimizers,
                            {"time": time.time()}, keep=config.train.keep_checkpoints)
        if config.eval.every and (step + 1) % config.eval.every == 0 and step + 1 < config.train.steps:
            log.log(step + 1, evaluate(run, run.eval_examples), kind="eval")

    after = evaluate(run, run.eval_examples)
    log.log(config.train.steps, after, kind="eval")
    log.close()
    summary = finish_run(run, before, after)
    (run.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary
