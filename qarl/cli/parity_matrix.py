"""`qarl parity`: how far the learner's logprobs are from the sampler's, per scheme and alignment.

For each quantization scheme the engine (a `kernel`-mode copy of the model) samples one batch
of responses: same prompts, same seed for every scheme. Then, for each alignment mode, a fresh
learner copy is built exactly as the trainer builds it (`qarl.train.policy.engine_copy` and
`quantize_learner`, so a recipe's `quant.include` / `exclude` / `options` apply to both sides;
`naive`: plain full precision), its `export_state` is pushed to the engine with `load_weights`
(for `naive` the engine receives full-precision weights and quantizes them itself), and the
learner recomputes the batch's logprobs:

- path `decode-replay`: `LocalEngine(learner).score(batch)`, the engine's own prefill + decode
  path with the sampled tokens forced: what the trainer uses for old_logp;
- path `full-sequence`: `qarl.train.learner.logprobs.response_logprobs`, one teacher-forced
  forward of prompt + response: the fast path the gradient comes from (reported for `kernel`
  alignment and for the identity scheme `none`, to show the floor of a plain forward).

Each (scheme, align, path) row holds, with d_t = old_logp_t - rollout_logp_t over response
tokens: mean / max |d_t|, k3-KL (KL(sampler || learner) per token), the sequence geometric
mismatch ratio rho_i = exp(mean_t d_t) (mean, min, max), mean |d_t| per response-position
bucket, the token count, whether old_logp equals rollout_logp bit for bit, and the seconds the
arm took. Scheme `none` is the floor: both sides full precision, one row per path.

Mixture-of-experts models (local engine, which records each token's experts in
`batch.routed_experts`): every row comes twice, without and with routing replay (the learner
uses the engine's experts, weighted by its own router, as `quant.routing_replay` does in
training), and decode-replay rows carry the routing disagreement: the fraction of response
tokens whose learner top-k expert set differs from the engine's, averaged over MoE layers
(`qarl.algo.diagnostics.routing_disagreement`; with replay it is still the learner routers'
own top-k, given the replayed experts of the layers below, as training logs it).
See docs/alignment.md for what the numbers mean; benchmarks/parity_table.py --results writes
a measured matrix into docs/results.md.

`engine` names the sampler in `qarl.rollout.ENGINES` (the trainer's table): with "vllm" the
samples come from a `VLLMEngine` (vLLM in this process, fed qarl's codes in compressed-tensors
layout) instead of the local engine; the alignments are those the engine serves (`naive` and
`fake`: the learner cannot run vLLM's kernels) and the schemes it serves here, in the dtype
`rollout.vllm_dtype = "auto"` chooses on this machine (each row's `engine` says which). A
sampler's files (vLLM's starting policy) live in a temporary folder removed with the scheme's
rows. Prompts are templated by the trainer's own `PromptEncoder`.
"""

from __future__ import annotations

import copy
import math
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qarl.config import LoraSection, QuantSection, TaskSection
from qarl.errors import UserError
from qarl.quant import ALIGNS, SCHEMES, scheme_options
from qarl.rollout import ENGINES
from qarl.tasks import make_task
from qarl.train.data import PromptEncoder
from qarl.types import RolloutBatch, SamplingParams
DECODE_REPLAY, FULL_SEQUENCE = "decode-replay", "full-sequence"
# Response-position buckets (start positions); empty buckets are left out of a row.
POSITION_BUCKETS = (0, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass
class Arm:
    """One measured (scheme, align, path): the learner's logprobs next to the batch."""

    scheme: str
    align: str
    path: str
    old_logp: Tensor  # [N, L] float32, the learner's logprobs of the sampled tokens
    batch: RolloutBatch  # the engine's samples; batch.rollout_logp [N, L] float32
    seconds: float  # learner build + weight push + scoring
    learner_layers: tuple[str, ...]  # the learner's QuantLinear layers (none when naive)
    routing_replay: bool | None = None  # MoE: learner ran the engine's experts; None: dense
    # MoE decode-replay: the learner routers' own top-k, [N, P + L, moe_layers, k] int16
    learner_routing: Tensor | None = None
    engine: str = "local"  # what sampled: "local", or "vllm <dtype>" (vLLM's dtype here)
    lora_rank: int = 0  # both sides carry the same planted LoRA adapters of this rank (0: none)


def check_names(schemes: Sequence[str], aligns: Sequence[str], options: dict | None = None,
                engine: str = "local") -> None:
    """Raise one UserError naming every unknown scheme / alignment / engine (and the valid
    ones), every scheme that does not take the quant `options` given, and every alignment or
    scheme the engine cannot be measured with here (`qarl.rollout.ENGINES`)."""
    problems = []
    kind = ENGINES.get(engine)
    if kind is None:
        problems.append(f"unknown engine {engine!r}; valid: {list(ENGINES)}")
    else:
        if not kind.installed():
            problems.append(f"engine {engine!r} needs the {kind.package} package; {kind.install}")
        problems += [f"alignment {a!r} cannot be measured with engine {engine!r} (the learner "
                     f"cannot run its kernels); use {list(kind.aligns)}"
                     for a in aligns if a in ALIGNS and a not in kind.aligns]
        unserved = [s for s in schemes if s in SCHEMES and s not in kind.schemes()]
        if unserved:
            problems.append(f"scheme(s) {unserved} are not served by engine {engine!r} on this "
                            f"machine; valid: {list(kind.schemes())}")
    bad_schemes = [s for s in schemes if s not in SCHEMES]
    if bad_schemes:
        problems.append(f"unknown scheme(s) {bad_schemes}; valid: {sorted(SCHEMES)}")
    bad_aligns = [a for a in aligns if a not in ALIGNS]
    if bad_aligns:
        problems.append(f"unknown alignment(s) {bad_aligns}; valid: {sorted(ALIGNS)}")
    if not schemes or not aligns:
        problems.append(f"need at least one scheme and one alignment, got schemes={list(schemes)} "
                        f"aligns={list(aligns)}")
    for scheme in [s for s in schemes if s in SCHEMES and options]:
        valid = scheme_options(scheme)
        unknown = sorted(set(options) - set(valid))
        if unknown:
            problems.append(f"scheme {scheme!r} takes no quant option(s) {unknown} (valid: "
                            f"{sorted(valid)}); measure it without them")
    if problems:
        raise UserError("; ".join(problems))


def encode_prompts(tokenizer, num_prompts: int, seed: int) -> list[list[int]]:
    """Held-out one-digit addition prompts, templated as the trainer templates them (the
    recipe's defaults: the task's system prompt, the chat template when the tokenizer has
    one)."""
    task_section = TaskSection(name="addition", options={"digits": 1})
    task = make_task("addition", digits=1)
    examples = task.examples("eval", num_prompts, seed)
    return PromptEncoder(task_section, tokenizer, task).encode_prompts(examples)


def _engine_codes(engine) -> dict[str, dict[str, Tensor]]:
    return {name: qw.tensors() for name, qw in engine.qweights().items()}


def _check_same_codes(before: dict, after: dict, scheme: str, align: str) -> None:
    """The pushed weights must be the ones the batch was sampled with, or rollout_logp is stale."""
    for name, tensors in before.items():
        now = after[name]
        if tensors.keys() != now.keys() or not all(torch.equal(tensors[k], now[k]) for k in now):
            raise RuntimeError(
                f"parity {scheme}/{align}: after the learner's weight push, engine layer {name} "
                f"holds different codes or scales than it sampled with; export_state/load_state "
                f"do not round-trip for this scheme (a bug in qarl.quant)"
            )


def run_arms(
    model_name: str,
    schemes: Sequence[str],
    aligns: Sequence[str] = ALIGNS,
    num_prompts: int = 16,
    max_new_tokens: int = 24,
    temperature: float = 1.0,
    seed: int = 0,
    include_full_sequence: bool = True,
    quant: QuantSection | None = None,
    engine: str = "local",
    lora: LoraSection | None = None,
    device: str = "cpu",
) -> Iterator[Arm]:
    """Yield one Arm per (scheme, align, path), scheme by scheme (see the module docstring).
    `quant` (a recipe's section; default: every projection in the blocks, no options) gives
    the include / exclude / options used for every scheme; its scheme and align are replaced.
    `engine`: what samples the batch, "local" or "vllm". `lora` (rank > 0): the sampler and
    every learner carry LoRA adapters on its targets, the same planted values on both sides
    (A ~ N(0, 1/r), B ~ N(0, 0.02^2) per layer from `seed`: an adapter as after training).
    `device`: where the sampler and the learners run, as train.device places them."""
    from qarl.model import load_model, load_tokenizer
    from qarl.quant import export_state, quant_layers
    from qarl.rollout import LocalEngine
    from qarl.lora.recipe import attach_adapters
    from qarl.train.learner.logprobs import response_logprobs
    from qarl.train.policy import engine_copy, quantize_learner

    quant = quant if quant is not None else QuantSection()
    check_names(schemes, aligns, quant.options, engine)
    rank = lora.rank if lora is not None else 0
    if rank and engine != "local":
        raise UserError("LoRA rows need the local engine: qarl pushes adapters into its own "
                        "engine only")

    def adapted(model):
        if rank:
            attach_adapters(model, lora, init="zeros")
            plant_adapters(model, seed)
        return model

    kind = ENGINES[engine]
    tokenizer = load_tokenizer(model_name)
    pristine = load_model(model_name).to(device)  # the trainer's placement (qarl.train.policy)
    moe = bool(pristine.config.moe_layers)
    if moe and kind.dense_only:
        raise UserError(f"engine {engine!r} takes dense models only; {model_name!r} is a "
                        "mixture-of-experts model: measure it with the local engine")
    prompts = encode_prompts(tokenizer, num_prompts, seed)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    longest = max(map(len, prompts)) + max_new_tokens
    # MoE: rows without and with routing replay (the local engine records the experts it used)
    replays = (False, True) if moe else (None,)
    for scheme in schemes:
        identity = SCHEMES[scheme].is_identity
        with tempfile.TemporaryDirectory(prefix="qarl-parity-") as folder:
            sampler = kind.build(adapted(engine_copy(pristine, quant.model_copy(update={"scheme": scheme}))),
                                 tokenizer, Path(folder), max_context=None, longest=longest,
                                 seed=seed, vllm_dtype="auto")
            batch = sampler.generate(prompts, sampling, seed=seed)
            sampled_with = _engine_codes(sampler)
            # The identity scheme: every alignment builds the same plain learner: measured once.
            for align in aligns if not identity else ("naive",):
                start = time.perf_counter()
                learner = adapted(quantize_learner(
                    copy.deepcopy(pristine), quant.model_copy(update={"scheme": scheme, "align": align})))
                sampler.load_weights(export_state(learner))
                _check_same_codes(sampled_with, _engine_codes(sampler), scheme, align)
                scorer = LocalEngine.from_tokenizer(learner, tokenizer)  # the learner's replay
                layers = tuple(quant_layers(learner))
                for replay in replays:
                    old_logp, routing = scorer.score_routing(batch, sampling, replay=bool(replay))
                    yield Arm(scheme, align, DECODE_REPLAY, old_logp, batch,
                              time.perf_counter() - start, layers, replay, routing,
                              engine=kind.label(sampler), lora_rank=rank)
                    if include_full_sequence and (align == "kernel" or identity):
                        start = time.perf_counter()
                        with torch.no_grad():
                            fast, _ = response_logprobs(learner, batch, temperature,
                                                        routing_replay=bool(replay))
                        yield Arm(scheme, align, FULL_SEQUENCE, fast, batch,
                                  time.perf_counter() - start, layers, replay,
                                  engine=kind.label(sampler), lora_rank=rank)
                    start = time.perf_counter()
            sampler.close()


def plant_adapters(model, seed: int) -> None:
    """Every LoRA layer's A ~ N(0, 1/r) and B ~ N(0, 0.02^2), drawn per layer name from `seed`:
    the same adapters on every copy of a model, and a B that is not zero."""
    import zlib

    from qarl.lora.layers import lora_layers

    with torch.no_grad():
        for name, layer in lora_layers(model).items():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            layer.lora_A.copy_(torch.randn(layer.lora_A.shape, generator=g) / layer.rank)
            layer.lora_B.copy_(0.02 * torch.randn(layer.lora_B.shape, generator=g))


def arm_row(arm: Arm) -> dict:
    """The JSON row of one arm (plain Python numbers; empty position buckets left out)."""
    from qarl.algo.diagnostics import mismatch_by_position, mismatch_metrics, routing_disagreement

    batch = arm.batch
    m = mismatch_metrics(arm.old_logp, batch.rollout_logp, batch.response_mask)
    buckets = mismatch_by_position(arm.old_logp, batch.rollout_logp, batch.response_mask,
                                   POSITION_BUCKETS)
    disagree = None
    if arm.learner_routing is not None and batch.routed_experts is not None:
        disagree = routing_disagreement(arm.learner_routing, batch.routed_experts,
                                        batch.response_mask)["routing_disagree_frac"]
    return {
        "scheme": arm.scheme,
        "align": arm.align,
        "engine": arm.engine,
        "path": arm.path,
        "mean_abs_dlogp": m["abs_diff_mean"],
        "max_abs_dlogp": m["abs_diff_max"],
        "k3_kl": m["k3_kl"],
        "seq_ratio_mean": m["seq_ratio_mean"],
        "seq_ratio_min": m["seq_ratio_min"],
        "seq_ratio_max": m["seq_ratio_max"],
        "by_position": {k: v for k, v in buckets.items() if not math.isnan(v)},
        "bit_exact": bool(torch.equal(arm.old_logp, batch.rollout_logp)),
        "num_tokens": int(batch.response_mask.sum()),
        "seconds": round(arm.seconds, 3),
        "routing_replay": arm.routing_replay,  # None: a dense model
        "routing_disagree_frac": disagree,  # None: dense, or a full-sequence row
        "lora_rank": arm.lora_rank,  # 0: no adapters
    }


def parity_matrix(
    model_name: str = "tiny",
    schemes: Sequence[str] | None = None,
    aligns: Sequence[str] = ALIGNS,
    num_prompts: int = 16,
    max_new_tokens: int = 24,
    temperature: float = 1.0,
    seed: int = 0,
    include_full_sequence: bool = True,
    quant: QuantSection | None = None,
    engine: str = "local",
    lora: LoraSection | None = None,
    device: str = "cpu",
) -> list[dict]:
    """One row (see `arm_row`) per (scheme, align, path); schemes default to all of SCHEMES."""
    from qarl.quant import SCHEMES

    schemes = list(SCHEMES) if schemes is None else list(schemes)
    arms = run_arms(model_name, schemes, aligns, num_prompts, max_new_tokens, temperature, seed,
                    include_full_sequence, quant, engine, lora, device)
    return [arm_row(arm) for arm in arms]


# ---- terminal table ----------------------------------------------------------------------


def _num(value: float) -> str:
    if value == 0:
        return "0"
    if math.isnan(value):
        return "nan"
    return f"{value:.2e}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.4f}"


def format_table(rows: list[dict]) -> str:
    """Rows as an aligned text table; one column per response-position bucket seen; vLLM rows
    add the engine (vLLM's dtype) and MoE rows the routing replay flag and the routing
    disagreement fraction after the path."""
    buckets = sorted({b for r in rows for b in r["by_position"]}, key=lambda b: int(b.split("-")[0].rstrip("+")))
    moe = any(r.get("routing_replay") is not None for r in rows)
    served = any(r["engine"] != "local" for r in rows)  # vLLM rows name vLLM's dtype
    lora = any(r.get("lora_rank") for r in rows)
    header = ["scheme", "align", "path", *(("lora r",) if lora else ()),
              *(("engine",) if served else ()),
              *(("replay", "route≠") if moe else ()), "mean|Δ|", "max|Δ|", "k3-KL", "ρ mean", "ρ min", "ρ max",
              "exact", *(f"|Δ| @{b}" for b in buckets), "tokens", "s"]
    lines = [header]
    for r in rows:
        lines.append([
            r["scheme"], r["align"], r["path"], *((str(r["lora_rank"]),) if lora else ()),
            *((r["engine"],) if served else ()),
            *(_routing_cells(r) if moe else ()),
            _num(r["mean_abs_dlogp"]), _num(r["max_abs_dlogp"]),
            _num(r["k3_kl"]), *(f"{r[k]:.6f}" for k in ("seq_ratio_mean", "seq_ratio_min", "seq_ratio_max")),
            "yes" if r["bit_exact"] else "no",
            *(_num(r["by_position"][b]) if b in r["by_position"] else "-" for b in buckets),
            str(r["num_tokens"]), f"{r['seconds']:.2f}",
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def _routing_cells(row: dict) -> tuple[str, str]:
    disagree = row["routing_disagree_frac"]
    return ("yes" if row["routing_replay"] else "no",
            "-" if disagree is None else f"{disagree:.4f}")


def progress_line(arm: Arm, row: dict) -> str:
    """The line printed when an arm is done (a smollm2 matrix takes minutes)."""
    replay = "" if arm.routing_replay is None else f"/replay={'yes' if arm.routing_replay else 'no'}"
    return (f"parity {arm.scheme}/{arm.align}/{arm.path}{replay}: mean|Δ| {_num(row['mean_abs_dlogp'])} "
            f"({arm.seconds:.1f} s)")
