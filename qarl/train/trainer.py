"""The RL trainer: `rl_step` is one step, `train` the loop around it. Read it top to bottom.

One step (`rl_step`, the phase table of docs/training.md): prompts -> the engine samples G
responses per prompt with the quantized weights -> rewards (worker processes, deadlines) ->
group advantages -> old_logp from the aligned learner (`Learner.replay`: the engine's own
decode path replayed with the sampled tokens, exact on CPU) -> K epochs of micro-batched
updates with the configured loss and rollout correction (`Learner.update`, the same on one
process and on learner ranks) -> the master weights are quantized once and pushed to the
engine. The loop (`train`) adds resume, evaluation, logging, checkpoints and the guards:
a stop signal is honoured only before a step's update (`check_stop`), so a stopped run saves
the checkpoint of its finished steps; a non-finite update is skipped and counted
(`guards.BadStepGuard`); out of memory ends the run with the settings to lower.
Under train.async_rollouts the step's batch comes from `AsyncRollouts`
(qarl/train/async_rollouts.py), which generates the next one in a background thread during
the update; the push waits for it, and the loop's checkpoints hold it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from qarl import jsonio
from qarl.config import RunConfig, load_config, to_toml
from qarl.errors import UserError
from qarl.native.memory import tune_allocator
from qarl.quant.contract import ContractBroken
from qarl.train import checkpoint
from qarl.train.budgets import OverBudget
from qarl.train.evaluate import evaluate
from qarl.train.guards import (
    BadStepGuard, NonFiniteWeights, RunStopped, TrainingAborted, is_out_of_memory,
    out_of_memory_message,
)
from qarl.parallel.ranks import LearnerRankDied
from qarl.train.async_rollouts import AsyncRollouts
from qarl.train.data import Data, learner_view, sampling_params
from qarl.train.folder import open_run
from qarl.train.learner.follow import learner_on_ranks
from qarl.train.metrics import MetricsLogger, start_wandb
from qarl.train.monitors import Monitors
from qarl.train.phases import (
    Experience, PhaseTimer, compute_advantages, reference_kl, reward_metrics, reward_responses,
    sample_metrics, train_examples,
)
from qarl.train.policy import Policy
from qarl.train.resume import ResumePoint, resume_point
from qarl.train.sft import warm_start
from qarl.train.signals import StopRequested, check_stop, stop_on_signals
from qarl.train.summary import finish_run
from qarl.types import RolloutBatch


def step_prompts(data: Data, config: RunConfig, step: int) -> tuple[list, list[list[int]]]:
    """The examples of `step` and its prompt ids, each prompt group_size times."""
    G = config.rollout.group_size
    examples = train_examples(data.task, config.run.seed, step, config.rollout.batch_size // G)
    return examples, [ids for ids in data.prompts.encode_prompts(examples) for _ in range(G)]


def generate(policy: Policy, config: RunConfig, step: int,
             prompt_ids: list[list[int]]) -> RolloutBatch:
    """The engine's batch of `step` (its sampling seed a function of (run.seed, step)), on
    the learner's device (where a remote or vLLM engine's batch is not)."""
    batch = policy.engine.generate(prompt_ids, sampling_params(config.rollout),
                                   seed=config.run.seed * 100_003 + step)
    return batch.to(policy.device)


def rl_step(policy: Policy, data: Data, config: RunConfig, step: int,
            rollouts: AsyncRollouts | None = None) -> dict[str, float]:
    """One RL step (0-based `step`): sample, reward, update the learner, push it to the engine.
    Returns the step's metrics (docs/training.md, "What a run logs"). A stop signal ends it
    (StopRequested) only before the update starts: after, the step runs to its end.
    `rollouts` (train.async_rollouts): the step's batch comes from there, and the next one is
    generated while this one trains (qarl/train/async_rollouts.py)."""
    if rollouts is None:
        return _step(policy, data, config, step, None)
    try:
        return _step(policy, data, config, step, rollouts)
    except BaseException:
        rollouts.abandon()  # the background generation stops before the error goes on
        raise


def _step(policy: Policy, data: Data, config: RunConfig, step: int,
          rollouts: AsyncRollouts | None) -> dict[str, float]:
    timer = PhaseTimer()
    G, seed = config.rollout.group_size, config.run.seed
    sampling = sampling_params(config.rollout)
    examples, prompt_ids = step_prompts(data, config, step)
    check_stop()
    if rollouts is None:
        with timer("generate"):
            batch = generate(policy, config, step, prompt_ids)
        staleness = {}
    else:  # the last step generates the next one too where the run may be extended
        sampled = rollouts.begin(step, step + 1 < config.train.steps
                                 or config.train.final_checkpoint == "full")
        batch = sampled.batch
        timer.seconds["generate"] = sampled.seconds
        staleness = {"async/staleness": float(step - sampled.version)}
    with timer("reward"):
        scored, completions = reward_responses(data.tokenizer, data.rewards, examples, batch, G)
        data.watch.observe(scored, f"step {step + 1}")  # RewardsFailed: a reward that never works
    check_stop()
    # the learner scores under the sampler's kept sets (or, correction off, the whole vocabulary)
    scoring, batch = learner_view(config.rollout, sampling, batch)
    stale = bool(staleness.get("async/staleness"))
    with timer("old_logp"):  # a replay, or an audit of one where it is exact (learner/audit.py)
        old = policy.audit.old_logp(policy.learner, batch, scoring, seed, step, stale)
    ref_logp, penalty, kl_metrics = None, None, {}
    if policy.reference is not None:  # algo.kl_coef > 0
        with timer("ref_logp"):
            ref_logp = policy.reference.logp(batch, scoring)
        penalty, kl_metrics = reference_kl(config.algo, old.logp, ref_logp, batch.response_mask)
    advantages, rows, group_metrics = compute_advantages(scored.rewards, batch, config.algo, G,
                                                         penalty)
    exp = Experience(batch, scoring, old.logp, advantages, rows, old.routing,
                     old.replayed_rows, old.replayed_logp,
                     ref_logp if config.algo.kl_in == "loss" else None)
    samples = sample_metrics(data.task, exp, completions)
    budget = policy.contract.check_step(samples, step, stale)  # OverBudget: before the update
    if rollouts is None:
        check_stop()
    else:  # the last stop check: from here the background generation runs to its end
        rollouts.commit()
    # the packs of the weights the update replaces are never read again: not in its peak
    # (the engine's are, where it is generating the next batch)
    if rollouts is None or not rollouts.in_flight:
        policy.engine.release_caches()
    policy.learner.release_caches()
    with timer("update"):
        update = policy.learner.update(exp, config.algo, config.train, step)
    if rollouts is not None:
        rollouts.finish()  # the push changes the engines' weights: after their generation
        staleness["time/generate_wait"] = rollouts.waited
    with timer("sync"):
        sync = policy.sync.push()
    generated = int(batch.response_mask.sum())
    return {
        **reward_metrics(scored), **group_metrics, **old.metrics, **kl_metrics, **update, **sync,
        **samples, **budget, **timer.metrics(), **staleness,
        "response/length_mean": generated / batch.num_sequences,
        "speed/tokens_per_s": generated / max(1e-9, timer.seconds["generate"]),
    }


def train(recipe: str | Path | Mapping | RunConfig | None = None,
          overrides: Mapping[str, Any] | Sequence[str] | None = None) -> dict[str, Any]:
    """Run RL training; return the summary (also written to run_dir/summary.json).

    Raises RunStopped after SIGTERM / SIGINT (a checkpoint of the finished steps saved),
    TrainingAborted when the run cannot go on (bad steps in a row, out of memory)."""
    config = load_config(recipe, overrides)  # every problem reported before any work starts
    tune_allocator()  # freed activation blocks reused step after step (qarl/native/memory.py)
    start = resume_point(config)  # a recipe that does not fit the checkpoint fails here
    with stop_on_signals(), open_run(config, learner=lambda: _warm_start(config)) as (
            folder, policy, data):
        policy.engine.stop_check = data.rewards.stop_check = check_stop
        rollouts = async_rollouts(policy, data, config)
        loop = Loop(config, folder.path, policy, data, rollouts)
        try:
            loop.start(start)
            with learner_on_ranks(config, policy.learner) as policy.learner:
                before, after = loop.run()
        except LearnerRankDied as err:  # a follower gone before it joined (no step taken)
            raise TrainingAborted(str(err)) from err
        finally:
            if rollouts is not None:
                rollouts.close()
            if hasattr(loop, "log"):
                loop.log.close()
        summary = finish_run(folder.path, config.log, before, after)
        summary["early_stop"] = loop.early_stop or None
        (folder.path / "summary.json").write_text(jsonio.dumps(summary, indent=1))
        return summary


def async_rollouts(policy: Policy, data: Data, config: RunConfig) -> AsyncRollouts | None:
    """The run's background rollouts under train.async_rollouts (None without), which become
    the engine's stop check (`AsyncRollouts.check`)."""
    if not config.train.async_rollouts:
        return None
    rollouts = AsyncRollouts(lambda step, ids: generate(policy, config, step, ids),
                             lambda step: step_prompts(data, config, step)[1],
                             config.train.async_staleness, check_stop)
    policy.engine.stop_check = rollouts.check
    return rollouts


def _warm_start(config: RunConfig):
    """`warm_start`, a stop signal in it ending the run (RunStopped, nothing saved)."""
    try:
        return warm_start(config)
    except StopRequested as stop:
        raise RunStopped(stop.signum, None, Path(config.run.output_dir) / config.run.name) from None


def check_reference(policy: Policy, state: dict, folder: Path) -> None:
    """A resumed run's reference (rebuilt from the warm start) is the one its checkpoint's
    steps were taken against, or the run stops before any step (UserError)."""
    saved = state.get("reference")
    if policy.reference is None or saved is None or saved == policy.reference.digest:
        return
    raise UserError(f"{folder} was trained against another reference policy than the one "
                    "this resume rebuilt from the recipe's warm start (the model files, the "
                    "warm start or [lora] changed since): the KL term would change meaning "
                    "mid-run. Restore the files the run started from, or start over with "
                    "--run.resume=false")


class Loop:
    """The steps of one run with what they carry between them: the steps done, the global RNG
    state at that point, the last checkpoint, the bad-step count, the metrics log, and under
    train.async_rollouts the batch generated for the next step (`rollouts`)."""

    def __init__(self, config: RunConfig, run_dir: Path, policy: Policy, data: Data,
                 rollouts: AsyncRollouts | None = None):
        self.config, self.run_dir, self.policy, self.data = config, run_dir, policy, data
        self.rollouts = rollouts
        self.guard = BadStepGuard(config.train.max_bad_steps)
        self.monitors = Monitors(config.monitor)
        self.done, self.saved = 0, None  # steps finished; the newest checkpoint, if any
        self.early_stop = ""  # the monitor alert that ended the run early, if one did

    def start(self, point: ResumePoint) -> None:
        """Restore the checkpoint (weights, optimizer, RNG, metrics so far) or start at step 0.
        Damaged checkpoints are set aside; only run.resume = false clears the folder, and a
        metrics file of a run that never saved a checkpoint is kept beside the new one."""
        for folder in point.damaged:
            checkpoint.set_aside(folder)
        resume_from = point.checkpoint
        if point.start_over:
            checkpoint.clear(self.run_dir)  # starting over: an old run's files must not linger
            (self.run_dir / checkpoint.METRICS).unlink(missing_ok=True)
        elif resume_from is None:
            checkpoint.keep_old_metrics(self.run_dir)
        else:
            learner = self.policy.learner
            state, rng = checkpoint.load(resume_from, learner.model, learner.optimizers)
            checkpoint.restore_metrics(resume_from, self.run_dir)
            checkpoint.restore_rng(rng)
            self.done, self.saved = state["step"], resume_from
            self.guard.in_a_row = state["bad_steps"]
            self.policy.audit.full_replay = state.get("full_replay", False)
            self.monitors = Monitors(self.config.monitor, state.get("monitor"))
            self.policy.contract.restore(state.get("contract") or {})
            check_reference(self.policy, state, resume_from)
            if self.rollouts is not None:
                self.rollouts.restore(state.get("async") or {},
                                      checkpoint.load_pending(resume_from))
                if self.rollouts.pending is not None:
                    pending = self.rollouts.pending
                    pending.batch = pending.batch.to(self.policy.device)
        try:  # the contract's layers first (a push to a layer of another format would fail
            # less clearly), then the engine decodes with the learner's current codes
            contract = self.policy.contract.start(self.policy.sync, self.run_dir)
            self.policy.sync.push()
        except ContractBroken as err:
            raise TrainingAborted(f"before step {self.done + 1}: {err}") from err
        log = self.config.log
        wandb_run = (start_wandb(self.run_dir, self.config.run.name, log.wandb_project,
                                 self.config.model_dump(mode="json", exclude_none=True))
                     if log.wandb else None)
        self.log = MetricsLogger(self.run_dir, self.config.train.steps, progress=log.progress,
                                 tensorboard=log.tensorboard, jsonl=log.jsonl, start_step=self.done,
                                 wandb_run=wandb_run)
        self.log.write(contract)
        if resume_from is not None:
            self.log.write(f"resumed from {resume_from} at step {self.done}")
        passes = self.policy.learner.passes
        self.log.write(f"learner on {self.policy.device}, gradient pass: "
                       + passes.precision.describe())
        self.log.write(self.policy.sync.describe())
        if self.config.train.logp_path == "forward":
            self.log.write(passes.values_line())
        self.rng = checkpoint.capture_rng()  # the state a checkpoint of `done` steps holds

    def run(self) -> tuple[dict | None, dict]:
        """Evaluate, take the remaining steps, evaluate; (before, after) eval metrics."""
        config, steps = self.config, self.config.train.steps
        try:
            before = self.evaluate() if self.done == 0 else None
            if self.eval_due():  # a resumed run redoes the eval its checkpoint came before
                self.evaluate()
            for step in range(self.done, steps):
                # (rollouts only where set: the synchronous loop calls rl_step as it always has)
                metrics = (rl_step(self.policy, self.data, config, step) if self.rollouts is None
                           else rl_step(self.policy, self.data, config, step, self.rollouts))
                metrics.update(self.monitors.update(metrics))
                for line in self.data.watch.take_lines():
                    self.log.write(line)
                if metrics.get("audit/failed"):
                    self.log.write(self.policy.audit.alert)
                if self.policy.contract.alert:
                    self.log.write(self.policy.contract.alert)
                if self.monitors.alert:
                    self.log.write(self.monitors.alert)
                self.log.log(step + 1, metrics)
                self.done, self.rng = step + 1, checkpoint.capture_rng()
                self.guard.update(self.done, metrics, self.saved)
                every = config.train.checkpoint_every
                if (every and self.done % every == 0) or self.done == steps:
                    self.save(last=self.done == steps)
                if self.monitors.started and config.monitor.early_stop:
                    self.early_stop = self.monitors.alert
                    if self.saved != checkpoint.step_folder(self.run_dir, self.done):
                        self.save()
                    self.log.write(f"monitor.early_stop: the run ends at step {self.done} of "
                                   f"{steps}; its checkpoint is saved")
                    break
                if self.eval_due():
                    self.evaluate()
                check_stop()
            return before, self.evaluate()
        except StopRequested as stop:
            if self.saved != checkpoint.step_folder(self.run_dir, self.done):
                self.save()
            raise RunStopped(stop.signum, self.saved, self.run_dir) from None
        except (LearnerRankDied, NonFiniteWeights, ContractBroken, OverBudget) as err:
            raise TrainingAborted(
                f"step {self.done + 1}: {err}. The last checkpoint is intact ("
                f"{self.saved or 'none yet'}): continue with qarl train --resume {self.run_dir}"
            ) from err
        except RuntimeError as err:
            if is_out_of_memory(err):
                raise TrainingAborted(out_of_memory_message(
                    err, config, self.done, self.run_dir, self.saved)) from err
            raise

    def eval_due(self) -> bool:
        every = self.config.eval.every
        return bool(every) and self.done % every == 0 and 0 < self.done < self.config.train.steps

    def evaluate(self) -> dict[str, float]:
        metrics = evaluate(self.policy, self.data, self.config)
        for line in self.data.watch.take_lines():
            self.log.write(line)
        self.log.log(self.done, metrics, kind="eval")
        return metrics

    def save(self, last: bool = False) -> None:
        """Checkpoint the steps done; `last`: the run's final step, saved without optimizer
        state under train.final_checkpoint = 'weights' (a stop or an early stop saves in
        full: the run may go on)."""
        train, learner = self.config.train, self.policy.learner
        state = {"time": time.time(), "bad_steps": self.guard.in_a_row,
                 "full_replay": self.policy.audit.full_replay, "monitor": self.monitors.state(),
                 "contract": self.policy.contract.state()}
        if self.policy.reference is not None:  # which reference the steps were taken against
            state["reference"] = self.policy.reference.digest
        pending = None
        if self.rollouts is not None:  # the next step's batch, generated by the last weights
            state["async"], pending = self.rollouts.state(self.done)
        optimizer_state = not (last and train.final_checkpoint == "weights")
        with learner.whole_optimizer_state():
            self.saved = checkpoint.save(self.run_dir, self.done, learner.model,
                                         learner.optimizers, state, self.rng,
                                         to_toml(self.config), train.keep_checkpoints,
                                         optimizer_state, pending)
