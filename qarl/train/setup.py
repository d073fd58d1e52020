"""Build the objects of a run from a validated RunConfig: its folder, the policy pair, the data.

Two copies of the policy live in one process, as they would on two machines (`Policy`):
- the learner (`qarl.train.learner.AlignedLearner`): master weights (fp32/bf16) with
  QuantLinear layers in the configured alignment (`kernel`: the engine's low-bit kernel with
  a straight-through backward; `fake`: float emulation of the quantizer; `naive`: plain full
  precision, no QuantLinear), their optimizers and the engine's decode path around them;
- the engine model: QuantLinear layers in `kernel` mode that decode with whatever the learner
  pushes through `LocalEngine.load_weights`: the learner's own codes and scales when it is
  aligned, its full-precision weights (quantized by the engine) in the naive setup.
`engine_copy` and `quantize_learner` build that pair; `qarl parity` builds its arms with them.

The data side (`Data`): the task, the prompt encoder, the reward workers, the eval examples.
`open_run` yields the run folder (locked), the policy and the data, and closes them after.
"""

from __future__ import annotations

import copy
import fcntl
import sys
from contextlib import closing, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO, Iterator

import torch

from qarl.config import (
    LoraSection, QuantSection, RolloutSection, RunConfig, TaskSection, TrainSection,
    save_resolved,
)
from qarl.errors import UserError
from qarl.model import DTYPES, CausalLM, load_model, load_tokenizer
from qarl.model.tokenizer import Tokenizer
from qarl.quant import SCHEMES, quantize_model, release_masters
from qarl.quant.lora import attach_lora, lora_names
from qarl.rollout import ENGINES, Engine, LocalEngine
from qarl.tasks import Example, RewardRunner, Task, make_task
from qarl.train.audit import ReplayAudit
from qarl.train.budgets import RunContract
from qarl.train.learner import AlignedLearner, Learner
from qarl.train.logprobs import ForwardScorer
from qarl.train.optim import build_optimizer
from qarl.train.precision import resolve_compute_dtype, resolve_quant_backward, set_quant_backward
from qarl.train.sync import WeightSync
from qarl.types import SamplingParams



class PromptEncoder:
    """Example -> prompt token ids: system prompt, chat template, length check, cache."""

    def __init__(self, task_cfg: TaskSection, tokenizer: Tokenizer, task: Task):
        self.task_cfg, self.tokenizer, self.task = task_cfg, tokenizer, task
        self.cache: dict[tuple, list[int]] = {}

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
        if cfg.chat_template and self.tokenizer.hf.chat_template is not None:
            return self.tokenizer.apply_chat(example.prompt, system=system, tokenize=True)
        text = example.prompt if system is None else f"{system}\n\n{example.prompt}"
        return self.tokenizer.encode(text)


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


@dataclass
class Policy:
    """The policy pair: the learner, the engine that samples, and what connects them."""

    learner: Learner  # master weights, their optimizers, replay and update (qarl.train.learner)
    engine: Engine  # samples with the quantized copy: a LocalEngine, a VLLMEngine
    # (rollout.engine), or qarl.parallel.RayEngines of either (dist.rollout_workers > 1)
    sync: WeightSync  # learner -> engine weight push
    quantized: bool  # False when the scheme is the identity (full-precision rollouts)
    audit: ReplayAudit  # how old_logp is computed: a replay, or an audit of one (train/audit.py)
    contract: RunContract  # the quantization contract: layer table, budget (train/budgets.py)

    @property
    def device(self) -> torch.device:
        """Where the learner trains (train.device)."""
        return next(self.learner.model.parameters()).device

    def close(self) -> None:
        """End the engine (its rollout workers' actors, if it has any)."""
        self.engine.close()


@dataclass
class Data:
    """The data side of a run: prompts in, scored completions out, and the eval examples."""

    task: Task
    tokenizer: Tokenizer
    prompts: PromptEncoder
    rewards: RewardRunner
    eval_examples: list[Example]

    def close(self) -> None:
        self.rewards.close()


@dataclass
class RunFolder:
    """The run's output folder, locked while the run lives: one process per folder."""

    path: Path
    lock: IO

    def close(self) -> None:
        self.lock.close()  # releases the flock


def sampling_params(rollout: RolloutSection) -> SamplingParams:
    """Training samples: the recipe's [rollout] section."""
    return SamplingParams(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                          top_p=rollout.top_p, top_k=rollout.top_k)


def build_task(config: RunConfig) -> Task:
    t = config.task
    if t.dataset is not None:
        return make_task("dataset", path=t.dataset, **t.options)
    return make_task(t.name, **t.options)


def _quant_kwargs(quant: QuantSection) -> dict:
    return dict(include=quant.include, exclude=quant.exclude, **quant.options)


def engine_copy(model: CausalLM, quant: QuantSection, codes_only: bool = False,
                lora: LoraSection | None = None) -> CausalLM:
    """A copy of `model` for the engine: its selected linears (quant.include / exclude) as
    `kernel`-mode QuantLinear of quant.scheme; a plain copy when the scheme is the identity.
    `codes_only`: the quantized layers keep their codes and scales, not the full-precision
    weights (`release_masters`), for an engine that an aligned learner updates with QWeights.
    `lora` (rank > 0): the same layers as the learner's get adapters, zero until the first
    push fills them with the learner's."""
    engine_model = copy.deepcopy(model)
    if not SCHEMES[quant.scheme].is_identity:
        quantize_model(engine_model, quant.scheme, mode="kernel", **_quant_kwargs(quant))
        if codes_only:
            release_masters(engine_model)
    if lora is not None and lora.rank:
        attach_adapters(engine_model, lora, init="zeros")
    return engine_model


def attach_adapters(model: CausalLM, lora: LoraSection, init: str | None = None) -> list[str]:
    """`qarl.quant.lora.attach_lora` with the recipe's [lora] (its init unless `init` says
    otherwise); a target or rank that does not fit the model is a UserError naming the key."""
    try:
        return attach_lora(model, lora.rank, lora.scale_alpha(), lora.dropout, lora.include,
                           lora.exclude, init or lora.init)
    except ValueError as err:
        raise UserError(f"[lora] {err}") from None


def adapt_learner(learner: CausalLM, config: RunConfig) -> list[str]:
    """The learner's adapters (`lora.rank` > 0: attached, frozen base, started from
    `lora.init_from` when given); returns the adapters' tensor names (none for full weights)."""
    if not config.lora.rank:
        return []
    attach_adapters(learner, config.lora)
    if config.lora.init_from is not None:
        from qarl.export.peft import import_peft

        import_peft(learner, config.lora.init_from, learner.config.family)
    return lora_names(learner)


def pushes_codes(config: RunConfig) -> bool:
    """The learner pushes QWeights (an aligned learner) to an engine of qarl's own (local, or
    Ray workers of it), which then needs no full-precision copy of its quantized layers (an
    identity scheme has none: `engine_copy` leaves the copy plain). The naive learner pushes
    full-precision weights; vLLM's engine writes its own files from the copy."""
    return config.quant.align != "naive" and config.rollout.engine == "local"


def quantize_learner(learner: CausalLM, quant: QuantSection,
                     train: TrainSection | None = None) -> CausalLM:
    """The learner in its alignment mode, in place: the same layers as the engine's copy in
    quant.align mode; left plain for `naive` or an identity scheme. With `train` (a learner
    that trains), its layers' backward is train.quant_backward's."""
    if not SCHEMES[quant.scheme].is_identity and quant.align != "naive":
        quantize_model(learner, quant.scheme, mode=quant.align, **_quant_kwargs(quant))
        if train is not None:
            device = torch.device(train.device)
            compute = resolve_compute_dtype(train.compute_dtype, device)
            set_quant_backward(learner, resolve_quant_backward(
                train.quant_backward, quant.scheme, quant.align, device, compute))
    return learner


def make_engine(config: RunConfig, model: CausalLM, tokenizer: Tokenizer,
                folder: Path | None) -> Engine:
    """The recipe's engine kind (`rollout.engine`, `qarl.rollout.ENGINES`) around `model`, the
    engine's copy; an engine that writes files (vLLM's starting policy) puts them in `folder`."""
    longest = config.task.max_prompt_tokens + max(config.rollout.max_new_tokens,
                                                  config.eval.max_new_tokens)
    return ENGINES[config.rollout.engine].build(
        model, tokenizer, folder, max_context=config.model.max_context, longest=longest,
        seed=config.run.seed, vllm_dtype=config.rollout.vllm_dtype)


def build_engine(config: RunConfig, worker: int = 0, run_dir: Path | None = None) -> Engine:
    """The rollout engine of `config` built from the model files, as Ray rollout worker
    `worker` builds its own (the trainer's first weight push then replaces all its weights);
    its files go to run_dir / "vllm_policy" / "worker<k>"."""
    model = load_model(config.model.name, dtype=DTYPES[config.model.master_dtype])
    folder = None if run_dir is None else Path(run_dir) / "vllm_policy" / f"worker{worker}"
    return make_engine(config, engine_copy(model, config.quant, pushes_codes(config), config.lora),
                       load_tokenizer(config.model.name), folder)


def make_replayer(config: RunConfig, model: CausalLM, tokenizer: Tokenizer,
                  max_context: int) -> LocalEngine | ForwardScorer:
    """The pass `Learner.replay` runs on the learner `model` (train.logp_path): the engine's
    decode path around it, or its teacher-forced forward without grad."""
    if config.train.logp_path == "forward":
        return ForwardScorer(model, config.train.micro_batch_size)
    return LocalEngine.from_tokenizer(model, tokenizer, max_context=max_context)


def replay_is_exact(config: RunConfig, moe: bool) -> bool:
    """The learner's replay equals the sampler's logprobs by construction (same kernels, same
    decode path): `kernel` alignment or full-precision rollouts, qarl's own engine, a dense
    model (a MoE model's routing metrics need the learner's own experts on every row)."""
    identity = SCHEMES[config.quant.scheme].is_identity
    return ((config.quant.align == "kernel" or identity) and config.rollout.engine == "local"
            and not moe)


def engine_label(config: RunConfig, engine: Engine) -> str:
    """The engine as `qarl parity` and the mismatch budgets name it ("local", "vllm float32");
    Ray actors of an engine kind share their kind's label (actor 0's dtype)."""
    kind = ENGINES[config.rollout.engine]
    if config.dist.rollout_workers > 1:
        return kind.name if kind.name == "local" else f"{kind.name} {config.rollout.vllm_dtype}"
    return kind.label(engine)


def build_policy(config: RunConfig, tokenizer: Tokenizer, learner: CausalLM | None = None,
                 run_dir: Path | None = None) -> Policy:
    """The policy pair; `learner`, when given, replaces loading `model.name` (warm start).
    With rollout.engine = 'vllm' the engine is a VLLMEngine whose starting policy is written
    to run_dir / "vllm_policy"; with dist.rollout_workers > 1, Ray actors of such engines (on
    one GPU each where vLLM runs on CUDA)."""
    if learner is None:
        learner = load_model(config.model.name, dtype=DTYPES[config.model.master_dtype])
    # the learner, and the local engine's copy made from it, on train.device
    learner = learner.to(config.train.device)
    max_context = config.model.max_context
    if config.dist.rollout_workers > 1:
        from qarl.parallel import RayEngines, connect  # Ray only when the recipe asks for it

        connect(config.dist.address)
        gpus = int(ENGINES[config.rollout.engine].uses_gpu and torch.cuda.is_available())
        engine = RayEngines(partial(build_engine, config, run_dir=run_dir),
                            config.dist.rollout_workers, gpus_per_worker=gpus)
    else:  # the engine's copy, made before the learner is quantized
        engine = make_engine(config, engine_copy(learner, config.quant, pushes_codes(config),
                                                 config.lora), tokenizer,
                             None if run_dir is None else Path(run_dir) / "vllm_policy")
    quantize_learner(learner, config.quant, config.train)
    adapters = adapt_learner(learner, config)  # trains the adapters only, when there are any
    train = config.train
    optimizers = build_optimizer(learner, train.optimizer, train.lr, train.weight_decay,
                                 tuple(train.betas))
    replayer = make_replayer(config, learner, tokenizer, max_context)
    identity = SCHEMES[config.quant.scheme].is_identity
    exact = replay_is_exact(config, bool(learner.config.moe_layers))
    audit = ReplayAudit(exact, config.train.audit_fraction, config.train.audit_full_every)
    return Policy(AlignedLearner(learner, optimizers, replayer, config.quant.routing_replay,
                                 train=config.train),
                  engine, WeightSync(learner, engine, config.quant.sync_check, adapters),
                  quantized=not identity, audit=audit,
                  contract=RunContract(config, exact, engine_label(config, engine)))


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
    rewards = RewardRunner(reward_spec, num_workers=config.task.reward_workers,
                           timeout_s=config.task.reward_timeout_s)
    eval_examples = task.examples("eval", config.eval.size, config.run.seed)
    return Data(task, tokenizer, prompts, rewards, eval_examples)


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


def open_run_folder(config: RunConfig) -> RunFolder:
    """Create and lock `run.output_dir / run.name`, and save the resolved recipe there."""
    path = Path(config.run.output_dir) / config.run.name
    path.mkdir(parents=True, exist_ok=True)
    folder = RunFolder(path, lock_run_dir(path))
    try:
        save_resolved(config, path)
    except BaseException:
        folder.close()
        raise
    return folder


@contextmanager
def open_run(config: RunConfig, learner: CausalLM | None = None) -> Iterator[tuple[RunFolder, Policy, Data]]:
    """The run's folder, policy pair and data side, closed (lock, reward workers) on exit.
    `learner`, when given, replaces loading `model.name` (warm-started weights)."""
    with closing(open_run_folder(config)) as folder:
        torch.manual_seed(config.run.seed)
        tokenizer = load_tokenizer(config.model.name)
        with closing(build_policy(config, tokenizer, learner, folder.path)) as policy, \
                closing(build_data(config, tokenizer, folder.path)) as data:
            yield folder, policy, data
