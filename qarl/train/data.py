"""The data side of a run (`Data`): the task, the prompt encoder, the reward workers and the
eval examples, built from a validated RunConfig (`build_data`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from qarl.config import RolloutSection, RunConfig, TaskSection
from qarl.errors import UserError
from qarl.model.tokenizer import Tokenizer, read_chat_template
from qarl.tasks import Example, RewardRunner, Task, make_task
from qarl.train.reward_watch import RewardWatch
from qarl.types import RolloutBatch, SamplingParams


class PromptEncoder:
    """Example -> prompt token ids: system prompt, chat template, length check, cache.

    `task.chat_template`: true uses the tokenizer's template where it has one, false encodes
    plain text, a string is a template (or its file) used instead of the tokenizer's."""

    def __init__(self, task_cfg: TaskSection, tokenizer: Tokenizer, task: Task):
        self.task_cfg, self.tokenizer, self.task = task_cfg, tokenizer, task
        self.cache: dict[tuple, list[int]] = {}
        choice = task_cfg.chat_template
        self.chat_template = read_chat_template(choice) if isinstance(choice, str) else None
        self.use_template = (self.chat_template is not None
                             or (choice is True and tokenizer.hf.chat_template is not None))

    def encode_prompts(self, examples: list[Example]) -> list[list[int]]:
        out = []
        for ex in examples:
            ids = self.template(ex)
            if len(ids) > self.task_cfg.max_prompt_tokens:
                raise ValueError(
                    f"a prompt has {len(ids)} tokens after templating, over "
                    f"task.max_prompt_tokens={self.task_cfg.max_prompt_tokens}: "
                    f"{ex.prompt[:80]!r}; raise the limit or shorten it")
            out.append(ids)
        return out

    def template(self, example: Example) -> list[int]:
        """The prompt's token ids after the system prompt and chat template (cached)."""
        key = (example.system, example.prompt)
        if key not in self.cache:
            self.cache[key] = self.encode(example)
        return self.cache[key]

    def encode(self, example: Example) -> list[int]:
        cfg = self.task_cfg
        system = example.system if example.system is not None else cfg.system_prompt
        if self.use_template:
            return self.tokenizer.apply_chat(example.prompt, system=system, tokenize=True,
                                             template=self.chat_template)
        text = example.prompt if system is None else f"{system}\n\n{example.prompt}"
        return self.tokenizer.encode(text)


def build_task(config: RunConfig) -> Task:
    t = config.task
    if t.dataset is not None:
        return make_task("dataset", path=t.dataset, **t.options)
    return make_task(t.name, **t.options)


def prompt_side(config: RunConfig, tokenizer: Tokenizer) -> tuple[Task, PromptEncoder]:
    """The run's task and its prompt encoder. A dataset's rows whose templated prompt has more
    than task.max_prompt_tokens tokens are left out and counted as `too_long` bad rows, before
    any step draws them; a dataset left with no training row is a UserError."""
    task = build_task(config)
    encoder = PromptEncoder(config.task, tokenizer, task)
    drop_rows = getattr(task, "drop_rows", None)
    if drop_rows is not None:
        limit = config.task.max_prompt_tokens
        try:
            drop_rows(lambda ex: len(encoder.template(ex)) > limit)
        except ValueError as err:
            raise UserError(f"task.dataset: {err} (task.max_prompt_tokens = {limit})") from None
    return task, encoder


def sampling_params(rollout: RolloutSection) -> SamplingParams:
    """Training samples: the recipe's [rollout] section."""
    return SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                          top_p=rollout.top_p, top_k=rollout.top_k, min_p=rollout.min_p)


def learner_view(rollout: RolloutSection, sampling: SamplingParams,
                 batch: RolloutBatch) -> tuple[SamplingParams, RolloutBatch]:
    """What the learner scores a step's samples under: the sampler's truncated distribution
    with its kept sets (the batch as generated), or, under rollout.truncation_correction =
    false, the whole vocabulary (the sampler's settings untruncated, the kept sets dropped)."""
    if sampling.truncates and not rollout.truncation_correction:
        return sampling.untruncated(), batch.without_kept()
    return sampling, batch


@dataclass
class Data:
    """The data side of a run: prompts in, scored completions out, and the eval examples."""

    task: Task
    tokenizer: Tokenizer
    prompts: PromptEncoder
    rewards: RewardRunner
    eval_examples: list[Example]
    watch: RewardWatch  # what the run does with rewards that fail

    def close(self) -> None:
        self.rewards.close()


def report_dataset(task: Task, run_dir: Path) -> None:
    """Bad rows of a dataset file are counted, never silently dropped: print the counts and
    keep them in the run folder (dataset_report.txt)."""
    reports = [r for r in (getattr(task, "report", None), getattr(task, "eval_report", None)) if r]
    if reports:
        text = "\n".join(r.summary() for r in reports)
        (run_dir / "dataset_report.txt").write_text(text + "\n")
        print(text, file=sys.stderr)


def build_data(config: RunConfig, tokenizer: Tokenizer, run_dir: Path) -> Data:
    """The task (its dataset report written to run_dir), reward workers and eval examples."""
    task, prompts = prompt_side(config, tokenizer)
    report_dataset(task, run_dir)
    reward_spec = config.task.reward or task.reward_spec
    try:
        rewards = RewardRunner(reward_spec, num_workers=config.task.reward_workers,
                               timeout_s=config.task.reward_timeout_s,
                               batched=config.task.reward_batch)
    except RuntimeError as err:  # a worker that cannot load the reward, or does not start
        raise UserError(f"task.reward: {err}") from None
    eval_examples = task.examples("eval", config.eval.size, config.run.seed)
    first_step = task.examples("train", config.rollout.batch_size // config.rollout.group_size,
                               config.run.seed)
    try:  # prompts too long for task.max_prompt_tokens: said now, before any model loads
        prompts.encode_prompts(first_step + eval_examples)
    except ValueError as err:
        rewards.close()
        raise UserError(f"task.max_prompt_tokens: {err}") from None
    watch = RewardWatch(reward_spec, run_dir, config.task.reward_error_warn)
    return Data(task, tokenizer, prompts, rewards, eval_examples, watch)
