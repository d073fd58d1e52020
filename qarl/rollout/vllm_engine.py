"""`VLLMEngine`: the `qarl.rollout.Engine` contract served by vLLM, in this process.

The engine keeps a qarl copy of the policy (`model`: kernel-mode QuantLinear layers, as the
local engine's) and a vLLM instance started from a folder written from it: compressed-tensors
for a quantized scheme, a plain Hugging Face folder for `none`. Each `load_weights` installs
the learner's state into the qarl copy exactly as `LocalEngine.load_weights` does (QWeights
as-is; full-precision weights quantized by qarl's own quantizer in the naive setup), converts
the result with `qarl.export.ct_state` and pushes it into vLLM: vLLM never quantizes a weight,
so learner, engine and export share one quantizer and one set of codes.

How the contract is met:
- generate: one vLLM request per row with its own seed, `qarl.rollout.sampling.row_seed` of
  the call's seed and the row's index in the whole batch (`row_offset + i`, the local engine's
  per-row seed), so a call's tokens depend on (weights, prompts, sampling, seed) only and a
  batch split over workers draws with the seeds it would get in one piece. vLLM's CPU
  sampler draws per-request seeds from the global torch RNG first; the engine saves and
  restores that RNG around every call, so the trainer's RNG stream is not moved.
  `rollout_logp` is vLLM's `processed_logprobs`: log_softmax of the logits after temperature,
  top-k and top-p (greedy: of the raw logits), the distribution each token was drawn from.
  Stop ids are qarl's EOS ids plus `sampling.stop_token_ids` (vLLM's own EOS handling is off);
  the stop id is kept as the response's last token.
- score: vLLM's prompt logprobs of prompt + response. They are the raw log-softmax, which is
  the sampler's distribution only for greedy decoding or temperature 1 without top-k / top-p
  (the RL defaults); other settings raise. They come from one prefill over the sequence, not
  from replayed decode steps, so they equal `generate`'s logprobs up to the GEMM rounding of a
  different batch shape (measured in tests/vllm_engine), not bit for bit.
- load_weights: non-quantized tensors (embedding, norms, lm_head, full-precision linears) go
  through vLLM's in-place reload (`reload_weights`, layerwise processing); each quantized
  linear gets its checkpoint-format tensors (q/k/v and gate/up stacked as vLLM fuses them) and
  reruns its scheme's `process_weights_after_loading`. (vLLM 0.32's layerwise reload leaves
  the CPU int8 kernel's oneDNN handle pointing at freed scale storage: its outputs go wrong.)
  `lm_head.weight` is always pushed, tied or not.

vLLM's CPU W8A8 int8 GEMM is not exact on x86 CPUs without VNNI (AVX2 / AVX-512 without
`avx512_vnni`, `avx_vnni` or AMX): its oneDNN kernel stores the activation codes as
u = q + 128 (uint8) and multiplies with `vpmaddubsw`, which adds each pair of adjacent
products u_k w_k + u_k+1 w_k+1 into int16 with saturation at +-32767 (two products of
255 x 127 reach 64770), then subtracts 128 * sum_k w_k. qarl's int8 GEMMs are exact
(qarl.native keeps |q| <= 127 in the uint8 operand and puts the sign on the weight, so a pair
stays below 2 x 127 x 127 < 32767). On SmolLM2-135M the saturation moves a linear layer's
output by 1e-2 relative (median; up to 0.13), where qarl's exact GEMM matches the float64
reference to 4e-8; the emulation
(each adjacent pair clamped to int16) reproduces vLLM's outputs to fp32 rounding (< 5e-8) on
all 120 int8 layers of one prefill, given vLLM's activation codes (its quantizer multiplies by
1 / s where qarl divides by s: 4 of 7.7M codes round the other way). The measured logprob gaps
are in qarl/rollout/README.md. With VNNI (vpdpbusd adds four products in int32) or on CUDA,
vLLM's int8 GEMM has no such saturation (not measured here).
`int8_gemm_saturates()` tells whether this CPU is affected; the engine logs a warning at start
and `describe` names the layers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from qarl.model.decoder import CausalLM
from qarl.native import build as native_build
from qarl.rollout.engine import left_pad, response_budget
from qarl.rollout.sampling import row_seed
from qarl.types import FINISH_LENGTH, FINISH_STOP, RolloutBatch, SamplingParams

KV_CACHE_BYTES = 256 * 2**20  # RL batches of short responses fit many times over
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # int8 dot products summed in int32
SATURATING = ("int16-saturating pair sums on this CPU (no VNNI): not the exact products qarl "
              "computes; see qarl/rollout/README.md")
log = logging.getLogger(__name__)


def int8_gemm_saturates(cpu_flags: set[str] | None = None) -> bool:
    """Whether vLLM's CPU int8 GEMM (oneDNN) sums pairs of uint8 x int8 products into int16
    with saturation here: an x86 CPU (`cpu_flags` from /proc/cpuinfo, read when None) with no
    VNNI / AMX-INT8 instruction (module docstring). False off x86 or where the flags are
    unknown."""
    flags = native_build.cpu_flags() if cpu_flags is None else cpu_flags
    return "sse2" in flags and not any(f in flags for f in VNNI_FLAGS)


def write_policy_folder(model: CausalLM, folder: Path) -> Path:
    """`model`'s current weights as a folder vLLM loads: config.json (+ the compressed-tensors
    `quantization_config` when a layer is quantized) and model.safetensors (tied lm_head once)."""
    from qarl.export import ct_state, quantization_config
    from qarl.model.names import state_on_disk
    from qarl.quant import QWeight, export_state

    state = state_on_disk(model.config.family, export_state(model))  # Mixtral's expert names
    folder.mkdir(parents=True, exist_ok=True)
    config = model.config.to_hf()
    config["dtype"] = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
    if any(isinstance(v, QWeight) for v in state.values()):
        config["quantization_config"] = quantization_config(state)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = ct_state(state)
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file({k: v.detach().contiguous().clone() for k, v in sorted(tensors.items())},
              folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@contextlib.contextmanager
def _global_rng_kept():
    """vLLM's CPU sampler reads the global torch RNG; put it back as it was."""
    state = torch.get_rng_state()
    try:
        yield
    finally:
        torch.set_rng_state(state)


class VLLMEngine:
    """Generates rollouts with vLLM (CPU build or CUDA) from `model`'s weights; implements
    `qarl.rollout.Engine`. `model` is the engine's qarl copy (`qarl.train.setup.engine_copy`);
    `folder` is where the starting policy is written for vLLM to load. eos / pad / max_context
    as for `LocalEngine`. vLLM runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 is set),
    eager (no compilation: seconds to start), with a small KV cache (`kv_cache_bytes`, raised
    to what one request of `max_context` tokens needs)."""

    stop_check = staticmethod(lambda: None)  # vLLM's generate runs to its end; see LocalEngine

    def __init__(self, model: CausalLM, folder: Path, eos_token_ids: Sequence[int] | None = None,
                 pad_token_id: int = 0, max_context: int | None = None, seed: int = 0,
                 kv_cache_bytes: int = KV_CACHE_BYTES):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model object stays reachable
        from vllm import LLM

        self.model = model
        self.eos_token_ids = tuple(
            model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_context = (model.config.max_position_embeddings if max_context is None
                            else max_context)
        self.folder = write_policy_folder(model, Path(folder))
        dtype = str(model.model.embed_tokens.weight.dtype).removeprefix("torch.")
        c = model.config  # vLLM refuses to start unless one request of max_context fits
        per_token = (2 * c.num_layers * c.num_kv_heads * c.head_dim
                     * model.model.embed_tokens.weight.element_size())  # K and V bytes
        kv_cache_bytes = max(kv_cache_bytes, int(1.25 * per_token * self.max_context))
        with _global_rng_kept():
            self.llm = LLM(model=str(self.folder), skip_tokenizer_init=True, enforce_eager=True,
                           dtype=dtype, seed=seed, logprobs_mode="processed_logprobs",
                           max_model_len=self.max_context, kv_cache_memory_bytes=kv_cache_bytes)
        self.last_sync_seconds = 0.0
        saturating = self.saturating_int8_layers()
        if saturating:
            log.warning(
                "vLLM runs %d int8 layers (first: %s) on oneDNN's int8 GEMM, which saturates "
                "pair sums at int16 on this CPU (no VNNI): its outputs differ from qarl's exact "
                "int8 products by up to ~1e-1 relative and its logprobs from the learner's by "
                "tenths of a nat (SmolLM2-135M). Use a CPU with VNNI/AMX or CUDA for int8 "
                "rollouts that follow the learner's arithmetic, or rollout.engine = 'local'",
                len(saturating), saturating[0])

    @classmethod
    def from_tokenizer(cls, model: CausalLM, tokenizer, folder: Path, **kwargs) -> "VLLMEngine":
        """EOS and pad ids from a tokenizer, as `LocalEngine.from_tokenizer`."""
        eos = tuple(tokenizer.eos_token_ids)
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = eos[0] if eos else 0
        return cls(model, folder, eos_token_ids=eos, pad_token_id=pad, **kwargs)

    # ---- the contract ---------------------------------------------------------------------

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams,
                 seed: int, row_offset: int = 0, prompt_width: int = 0) -> RolloutBatch:
        """One response per prompt (see the module docstring and `qarl.rollout.Engine`); row i
        samples with the seed of row `row_offset + i`. The returned prompts are left-padded to
        at least `prompt_width`, which also sets the response budget as for the whole batch
        (vLLM itself runs the prompts unpadded)."""
        ids, prompt_mask = left_pad(prompt_ids, self.model.config.vocab_size, self.pad_token_id,
                                    width=prompt_width)
        budget = response_budget(self.max_context, ids.shape[1], sampling.max_new_tokens)
        params = [self._params(sampling, budget, row_seed(seed, row_offset + i))
                  for i in range(len(prompt_ids))]
        outputs = self._run(prompt_ids, params)
        N = len(outputs)
        response = torch.full((N, budget), self.pad_token_id, dtype=torch.long)  # [N, budget]
        logp = torch.zeros(N, budget, dtype=torch.float32)  # [N, budget]
        reasons = []
        for i, out in enumerate(outputs):
            completion = out.outputs[0]
            tokens = list(completion.token_ids)
            response[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            logp[i, : len(tokens)] = torch.tensor(
                [step[t].logprob for step, t in zip(completion.logprobs, tokens)])
            reasons.append(FINISH_STOP if completion.finish_reason == "stop" else FINISH_LENGTH)
        lengths = torch.tensor([len(o.outputs[0].token_ids) for o in outputs])  # [N]
        L = int(lengths.max())
        mask = torch.arange(L)[None, :] < lengths[:, None]  # [N, L] bool
        return RolloutBatch(prompt_ids=ids, prompt_mask=prompt_mask,
                            response_ids=response[:, :L].clone(), response_mask=mask,
                            rollout_logp=logp[:, :L].clone(), finish_reasons=reasons)

    def score(self, batch: RolloutBatch, sampling: SamplingParams) -> Tensor:
        """vLLM's logprobs of `batch.response_ids`, [N, L] float32, 0 on padding: prompt
        logprobs of prompt + response, one prefill per row (see the module docstring for where
        this differs from `generate`). Greedy, or temperature 1 without top-k / top-p only."""
        if not sampling.greedy and (sampling.temperature != 1.0 or sampling.top_k > 0
                                    or sampling.top_p < 1.0):
            raise ValueError(
                f"VLLMEngine.score computes vLLM's prompt logprobs, the raw log-softmax, which "
                f"is the sampler's distribution only for greedy decoding or temperature 1 "
                f"without truncation; got temperature={sampling.temperature}, "
                f"top_k={sampling.top_k}, top_p={sampling.top_p}. Score with a LocalEngine "
                f"around the same weights instead")
        self._check_mask(batch, sampling)
        from vllm import SamplingParams as VllmParams

        sequences = [row[m].tolist() for row, m in zip(batch.sequence_ids(), batch.sequence_mask())]
        params = VllmParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outputs = self._run(sequences, [params] * len(sequences))
        logp = torch.zeros(batch.response_ids.shape, dtype=torch.float32)  # [N, L]
        prompt_lengths = batch.prompt_mask.sum(dim=1).tolist()
        for i, out in enumerate(outputs):
            P, seq = prompt_lengths[i], sequences[i]
            logp[i, : len(seq) - P] = torch.tensor(
                [out.prompt_logprobs[j][seq[j]].logprob for j in range(P, len(seq))])
        return logp

    def load_weights(self, state: dict) -> None:
        """Install `state` in the qarl copy (`qarl.quant.load_state`: names, schemes and
        shapes checked), then push the copy's codes and tensors into vLLM. The seconds it took
        are kept in `last_sync_seconds`."""
        from qarl.export import ct_state
        from qarl.quant import export_state, load_state

        start = time.perf_counter()
        with torch.no_grad():
            load_state(self.model, state)
        tensors = ct_state(export_state(self.model))
        vllm_model = self._vllm_model()
        quantized = {name: layer for name, layer in vllm_model.named_modules()
                     if hasattr(layer, "scheme")}
        packed = getattr(vllm_model, "packed_modules_mapping", {})
        layer_tensors = {name: self._take_layer(tensors, name, packed) for name in quantized}
        with _quiet_vllm_reload():
            self.llm.collective_rpc("reload_weights",
                                    kwargs={"weights_iterator": iter(list(tensors.items()))})
        with torch.no_grad():
            for name, layer in quantized.items():
                _install_checkpoint_tensors(layer, layer_tensors[name])
        self.last_sync_seconds = time.perf_counter() - start

    def describe(self) -> dict[str, str]:
        """Per vLLM module with weights: its class and, when quantized, the compressed-tensors
        scheme and kernel class vLLM picked."""
        out, saturating = {}, set(self.saturating_int8_layers())
        for name, module in self._vllm_model().named_modules():
            scheme = getattr(module, "scheme", None)
            if scheme is not None:
                kernel = type(getattr(scheme, "kernel", scheme)).__name__
                out[name] = f"vLLM {type(module).__name__}, {type(scheme).__name__} on {kernel}"
                if name in saturating:
                    out[name] += f" ({SATURATING})"
            elif name.endswith(("lm_head", "embed_tokens")):
                out[name] = f"vLLM {type(module).__name__}, full precision"
        return out

    def saturating_int8_layers(self) -> list[str]:
        """vLLM's layers that run the CPU oneDNN int8 GEMM, when that GEMM saturates on this
        CPU (`int8_gemm_saturates`); [] otherwise."""
        if not int8_gemm_saturates():
            return []
        names = []
        for name, module in self._vllm_model().named_modules():
            kernel = getattr(getattr(module, "scheme", None), "kernel", None)
            method = getattr(kernel, "linear_method", None)
            if getattr(method, "__name__", "") == "_apply_weights_onednn":
                names.append(name)
        return names

    # ---- helpers ----------------------------------------------------------------------------

    def _params(self, sampling: SamplingParams, budget: int, seed: int):
        from vllm import SamplingParams as VllmParams

        stops = sorted({*self.eos_token_ids, *sampling.stop_token_ids})
        common = dict(max_tokens=budget, logprobs=0, seed=seed, stop_token_ids=stops,
                      ignore_eos=True, detokenize=False)
        if sampling.greedy:
            return VllmParams(temperature=0.0, **common)
        return VllmParams(temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k, **common)

    def _run(self, prompts: list[list[int]], params: list) -> list:
        from vllm.inputs import TokensPrompt

        with _global_rng_kept():
            return self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                     use_tqdm=False)

    def _vllm_model(self) -> torch.nn.Module:
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()

    def _check_mask(self, batch: RolloutBatch, sampling: SamplingParams) -> None:
        """response_mask must be what generate gives for these tokens: a row ends at its first
        stop id, or runs to the last column."""
        stops = torch.tensor(sorted({*self.eos_token_ids, *sampling.stop_token_ids}))
        hit = torch.isin(batch.response_ids, stops)  # [N, L]
        L = hit.shape[1]
        first_stop = torch.where(hit.any(dim=1), hit.int().argmax(dim=1) + 1, L)  # [N] lengths
        expected = torch.arange(L)[None, :] < first_stop[:, None]  # [N, L] bool
        if not torch.equal(expected, batch.response_mask):
            raise ValueError(
                "score(): the batch's response_mask does not follow from its tokens (a row ends "
                "at its first EOS/stop id, or runs to the last column); pass a RolloutBatch "
                "produced by generate() with the same stop ids")

    @staticmethod
    def _take_layer(tensors: dict[str, Tensor], module: str, packed: dict) -> dict[str, Tensor]:
        """Remove and return one vLLM quantized layer's checkpoint tensors, its packed parts
        (q, k, v -> qkv_proj) stacked along the output dimension."""
        parent, _, leaf = module.rpartition(".")
        parts = [f"{parent}.{p}" for p in packed.get(leaf, [leaf])]
        leaves = sorted({k[len(parts[0]) + 1:] for k in tensors if k.startswith(parts[0] + ".")})
        if not leaves:
            raise KeyError(f"no tensors for vLLM's quantized layer {module} (looked for "
                           f"{parts[0]}.*); the state and the served model do not match")
        return {leaf_name: torch.cat([tensors.pop(f"{p}.{leaf_name}") for p in parts])
                for leaf_name in leaves}


def _install_checkpoint_tensors(layer: torch.nn.Module, tensors: dict[str, Tensor]) -> None:
    """Give a vLLM quantized layer fresh checkpoint-format parameters and let its scheme
    repack them (what loading a checkpoint does), so no state of the old weights survives."""
    for name, value in tensors.items():
        layer.register_parameter(name, torch.nn.Parameter(value.clone(), requires_grad=False))
    layer.scheme.process_weights_after_loading(layer)


@contextlib.contextmanager
def _quiet_vllm_reload():
    """The quantized layers are left out of vLLM's reload on purpose; its per-layer "Failed to
    load weights" warnings would say otherwise."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
