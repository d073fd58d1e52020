"""The policy pair of a run (`Policy`), built from a validated RunConfig (`build_policy`).

Two copies of the policy live in one process, as they would on two machines:
- the learner (`qarl.train.learner.AlignedLearner`): master weights (fp32/bf16) with
  QuantLinear layers in the configured alignment (`kernel`: the engine's low-bit kernel with
  a straight-through backward; `fake`: float emulation of the quantizer; `naive`: plain full
  precision, no QuantLinear), their optimizers, and its passes (the engine's decode path
  around them, or its teacher-forced forward) in the run's `Precision`;
- the engine model: QuantLinear layers in `kernel` mode that decode with whatever the learner
  pushes through `LocalEngine.load_weights`: the learner's own codes and scales when it is
  aligned, its full-precision weights (quantized by the engine) in the naive setup.
`engine_copy` and `quantize_learner` build that pair; `qarl parity` builds its arms with them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from qarl.config import LoraSection, QuantSection, RunConfig
from qarl.lora.recipe import adapt_learner, attach_adapters
from qarl.model import DTYPES, CausalLM, load_model, load_tokenizer
from qarl.model.tokenizer import Tokenizer
from qarl.quant import SCHEMES, quantize_model, release_masters
from qarl.rollout import ENGINES, Engine, LocalEngine
from qarl.train.data import sampling_params
from qarl.train.budgets import RunContract
from qarl.train.learner.audit import ReplayAudit
from qarl.train.learner.learner import AlignedLearner, Learner
from qarl.train.learner.logprobs import ForwardScorer
from qarl.train.learner.optim import build_optimizer
from qarl.train.learner.passes import Passes
from qarl.train.learner.precision import Precision
from qarl.train.learner.reference import Reference
from qarl.train.sync import WeightSync, sync_deltas


@dataclass
class Policy:
    """The policy pair: the learner, the engine that samples, and what connects them."""

    learner: Learner  # master weights, optimizers, passes, replay and update (train/learner)
    engine: Engine  # samples with the quantized copy: a LocalEngine, a VLLMEngine
    # (rollout.engine), or qarl.parallel.RayEngines of either (dist.rollout_workers > 1)
    sync: WeightSync  # learner -> engine weight push
    quantized: bool  # False when the scheme is the identity (full-precision rollouts)
    audit: ReplayAudit  # how old_logp is computed: a replay, or an audit of one
    contract: RunContract  # the quantization contract: layer table, budget (train/budgets.py)
    reference: Reference | None = None  # the KL term's frozen policy (algo.kl_coef > 0)

    @property
    def device(self) -> torch.device:
        """Where the learner trains (train.device)."""
        return next(self.learner.model.parameters()).device

    def close(self) -> None:
        """End the engine (its rollout workers' actors, if it has any)."""
        self.engine.close()


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


def pushes_codes(config: RunConfig) -> bool:
    """The learner pushes QWeights (an aligned learner) to an engine of qarl's own (local, or
    Ray workers of it), which then needs no full-precision copy of its quantized layers (an
    identity scheme has none: `engine_copy` leaves the copy plain). The naive learner pushes
    full-precision weights; vLLM's engine writes its own files from the copy."""
    return config.quant.align != "naive" and config.rollout.engine == "local"


def quantize_learner(learner: CausalLM, quant: QuantSection) -> CausalLM:
    """The learner in its alignment mode, in place: the same layers as the engine's copy in
    quant.align mode; left plain for `naive` or an identity scheme."""
    if not SCHEMES[quant.scheme].is_identity and quant.align != "naive":
        quantize_model(learner, quant.scheme, mode=quant.align, **_quant_kwargs(quant))
    return learner


def learner_model(model: CausalLM, config: RunConfig, precision: Precision,
                  adapters: bool = True) -> tuple[CausalLM, list[str]]:
    """`model` made the learner of `config`, in place: quantized in its alignment, its layers'
    backward `precision`'s, and (`adapters`) the recipe's LoRA adapters; -> (the model, the
    adapters' tensor names: none for full weights)."""
    quantize_learner(model, config.quant)
    precision.apply(model)
    return model, adapt_learner(model, config.lora) if adapters else []


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
                  precision: Precision) -> LocalEngine | ForwardScorer:
    """The value pass of the learner `model` (train.logp_path): the engine's decode path
    around it, or its teacher-forced forward without grad."""
    if config.train.logp_path == "forward":
        return ForwardScorer(model, config.train.micro_batch_size, precision)
    return LocalEngine.from_tokenizer(model, tokenizer, max_context=config.model.max_context)


def replay_is_exact(config: RunConfig, moe: bool) -> bool:
    """The learner's replay equals the sampler's logprobs by construction (same kernels, same
    decode path): `kernel` alignment or full-precision rollouts, qarl's own engine, a dense
    model (a MoE model's routing metrics need the learner's own experts on every row), and a
    learner that scores the distribution sampled (not truncated sampling without
    rollout.truncation_correction)."""
    identity = SCHEMES[config.quant.scheme].is_identity
    biased = sampling_params(config.rollout).truncates and not config.rollout.truncation_correction
    return ((config.quant.align == "kernel" or identity) and config.rollout.engine == "local"
            and not moe and not biased)


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
    precision = Precision.of(config.train, config.quant)
    # the adapters train alone, when there are any
    learner, adapters = learner_model(learner, config, precision)
    train = config.train
    optimizers = build_optimizer(learner, train.optimizer, train.lr, train.weight_decay,
                                 tuple(train.betas))
    passes = Passes(learner, make_replayer(config, learner, tokenizer, precision), precision,
                    train, config.quant.routing_replay)
    # the KL term's reference: this learner before any update, frozen (learner/reference.py)
    reference = None if not config.algo.kl_coef else Reference.of(
        learner, lambda frozen: make_replayer(config, frozen, tokenizer, precision),
        config.quant.routing_replay)
    identity = SCHEMES[config.quant.scheme].is_identity
    exact = replay_is_exact(config, bool(learner.config.moe_layers))
    audit = ReplayAudit(exact, config.train.audit_fraction, config.train.audit_full_every)
    return Policy(AlignedLearner(passes, optimizers),
                  engine, WeightSync(learner, engine, config.quant.sync_check, adapters,
                                     delta=sync_deltas(config, engine)),
                  quantized=not identity, audit=audit,
                  contract=RunContract(config, exact), reference=reference)
