"""Build everything a run needs from a validated RunConfig: folders, task, models, engine.

Two copies of the policy live in one process, as they would on two machines:
- the learner: master weights (fp32/bf16) with QuantLinear layers in the configured
  alignment (`kernel`: the engine's low-bit kernel with a straight-through backward;
  `fake`: float emulation of the quantizer; `naive`: plain full precision);
- the engine model: QuantLinear layers in `kernel` mode that decode with whatever the learner
  pushes through `LocalEngine.load_weights`: the learner's own codes and scales when it is
  aligned, its full-precision weights (quantized by the engine) in the naive setup.
"""

from __future__ import annotations

import copy
import fcntl
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch

from qarl.config import RunConfig, save_resolved
from qarl.model import CausalLM, load_model, load_tokenizer
from qarl.model.tokenizer import Tokenizer
from qarl.quant import quantize_model
from qarl.rollout import LocalEngine
from qarl.tasks import Example, RewardRunner, Task, make_task
from qarl.types import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class PromptEncoder:
    """Example -> prompt token ids: system prompt, chat template, length check, cache."""

    def __init__(self, config: RunConfig, tokenizer: Tokenizer, task: Task):
        self.config, self.tokenizer, self.task = config, tokenizer, task
        self.cache: dict[tuple, list[int]] = {}

    def encode_prompts(self, examples: list[Example]) -> list[list[int]]:
        out = []
        for ex in examples:
            key = (ex.system, ex.prompt)
            if key not in self.cache:
                self.cache[key] = self.encode(ex)
            out.append(self.cache[key])
        return out

    def encode(self, example: Example) -> list[int]:
        cfg = self.config.task
        system = example.system if example.system is not None else cfg.system_prompt
        if cfg.chat_template and self.tokenizer.hf.chat_template is not None:
            ids = self.tokenizer.apply_chat(example.prompt, system=system, tokenize=True)
        else:
            text = example.prompt if system is None else f"{system}\n\n{example.prompt}"
            ids = self.tokenizer.encode(text)
        if len(ids) > cfg.max_prompt_tokens:
            raise ValueError(
                f"a prompt has {len(ids)} tokens after templating, over task.max_prompt_tokens="
                f"{cfg.max_prompt_tokens}: {example.prompt[:80]!r}; raise the limit or shorten it"
            )
        return ids


@dataclass
class Run:
    config: RunConfig
    run_dir: Path
    task: Task
    tokenizer: Tokenizer
    learner: CausalLM
    engine: LocalEngine
    rewards: RewardRunner
    eval_examples: list[Example]
    prompts: PromptEncoder
    scorer: LocalEngine  # the engine's decode path around the LEARNER model: old_logp
    lock: IO  # held open for the whole run: one process per run folder

    def close(self) -> None:
        self.rewards.close()
        self.lock.close()  # releases the flock

    @property
    def quantized(self) -> bool:
        return self.config.quant.scheme != "none"

    def sampling(self) -> SamplingParams:
        r = self.config.rollout
        return SamplingParams(max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                              top_p=r.top_p, top_k=r.top_k)

    def eval_sampling(self) -> SamplingParams:
        e = self.config.eval
        return SamplingParams(max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                              greedy=e.greedy)

    def encode_prompts(self, examples: list[Example]) -> list[list[int]]:
        return self.prompts.encode_prompts(examples)

    def train_examples(self, step: int) -> list[Example]:
        """The prompts of `step`: a pure function of (seed, step), so a resumed run sees the
        same data it would have seen without the interruption."""
        r = self.config.rollout
        seed = random.Random(f"{self.config.run.seed}:{step}").getrandbits(31)
        return self.task.examples("train", r.batch_size // r.group_size, seed)


def build_task(config: RunConfig) -> Task:
    t = config.task
    if t.dataset is not None:
        return make_task("dataset", path=t.dataset, **t.options)
    return make_task(t.name, **t.options)


def quantize_pair(learner: CausalLM, config: RunConfig) -> CausalLM:
    """Quantize the learner in place in its alignment mode and return the engine's copy."""
    q = config.quant
    engine_model = copy.deepcopy(learner)
    if q.scheme == "none":
        return engine_model
    kwargs = dict(include=q.include, exclude=q.exclude, **q.options)
    quantize_model(engine_model, q.scheme, mode="kernel", **kwargs)
    if q.align != "naive":
        quantize_model(learner, q.scheme, mode=q.align, **kwargs)
    return engine_model


def report_dataset(task: Task, run_dir: Path) -> None:
    """Bad rows of a dataset file are counted, never silently dropped: print the counts and
    keep them in the run folder (dataset_report.txt)."""
    reports = [r for r in (getattr(task, "report", None), getattr(task, "eval_report", None)) if r]
    if reports:
        text = "\n".join(r.summary() for r in reports)
        (run_dir / "dataset_report.txt").write_text(text + "\n")
        print(text, file=sys.stderr)


def lock_run_dir(run_dir: Path) -> IO:
    """An exclusive lock on the run folder: two processes writing one folder's metrics and
    checkpoints would corrupt both runs."""
    handle = open(run_dir / ".lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise RuntimeError(
            f"another qarl process is running in {run_dir}; wait for it, or give this run "
            f"another name (--run.name=...) or output folder (--run.output_dir=...)"
        ) from None
    return handle


def build_run(config: RunConfig, learner: CausalLM | None = None) -> Run:
    """Create the run folder and every object of the run. `learner`, when given, replaces
    loading `model.name` (warm-started weights)."""
    run_dir = Path(config.run.output_dir) / config.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    lock = lock_run_dir(run_dir)
    try:
        save_resolved(config, run_dir)
        torch.manual_seed(config.run.seed)
        tokenizer = load_tokenizer(config.model.name)
        if learner is None:
            learner = load_model(config.model.name, dtype=DTYPES[config.model.master_dtype])
        engine_model = quantize_pair(learner, config)
        engine = LocalEngine.from_tokenizer(engine_model, tokenizer, max_context=config.model.max_context)
        scorer = LocalEngine.from_tokenizer(learner, tokenizer, max_context=config.model.max_context)
        task = build_task(config)
        report_dataset(task, run_dir)
        reward_spec = config.task.reward or task.reward_spec
        rewards = RewardRunner(reward_spec, num_workers=config.task.reward_workers,
                               timeout_s=config.task.reward_timeout_s)
        eval_examples = task.examples("eval", config.eval.size, config.run.seed)
        prompts = PromptEncoder(config, tokenizer, task)
        return Run(config, run_dir, task, tokenizer, learner, engine, rewards, eval_examples, prompts,
                   scorer, lock)
    except BaseException:
        lock.close()
        raise
