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
  different batch shape (tests/vllm_engine checks it), not bit for bit.
- load_weights: non-quantized tensors (embedding, norms, lm_head, full-precision linears) go
  through vLLM's in-place reload (`reload_weights`, layerwise processing); each quantized
  linear gets its checkpoint-format tensors (q/k/v and gate/up stacked as vLLM fuses them) and
  reruns its scheme's `process_weights_after_loading`. (vLLM 0.32's layerwise reload leaves
  the CPU int8 kernel's oneDNN handle pointing at freed scale storage: its outputs go wrong.)
  `lm_head.weight` is always pushed, tied or not.

The dtype vLLM runs in (`dtype`, `rollout.vllm_dtype`): float32, the learner's precision,
wherever vLLM's int8 kernel takes it; bfloat16 where it does not (x86 CPUs with AMX, whose int8
kernel takes only 16-bit activations: `qarl.rollout.vllm_support`) or for a bfloat16 master.
In bfloat16 vLLM's embeddings, norms, attention, activations and lm_head round to bf16 where
the `fake` learner computes in fp32 (measured by `benchmarks/vllm_int8_gap.py --dtype
bfloat16`).

vLLM's CPU W8A8 int8 GEMM (oneDNN) is not exact on x86 CPUs without VNNI (AVX2 / AVX-512
without `avx512_vnni`, `avx_vnni` or AMX): its oneDNN kernel stores the activation codes as
u = q + 128 (uint8) and multiplies with `vpmaddubsw`, which adds each pair of adjacent
products u_k w_k + u_k+1 w_k+1 into int16 with saturation at +-32767 (two products of
255 x 127 reach 64770), then subtracts 128 * sum_k w_k. qarl's int8 GEMMs are exact
(qarl.native keeps |q| <= 127 in the uint8 operand and puts the sign on the weight, so a pair
stays below 2 x 127 x 127 < 32767). The saturation moves a linear layer's output far past fp32
rounding, where qarl's exact GEMM matches the float64 reference to fp32 rounding; an emulation
(each adjacent pair clamped to int16) reproduces vLLM's outputs to fp32 rounding, given vLLM's
activation codes (its quantizer multiplies by 1 / s where qarl divides by s, so a few codes
round the other way). With VNNI (vpdpbusd adds four products in int32) vLLM's layers match the
exact products to fp32 rounding. Even so vLLM's int8 logprobs are not qarl's: per-token int8
activation quantizers amplify last-bit differences of attention and norms into flipped codes
(qarl's own exact engine against its fake learner shows the same floor).
`benchmarks/vllm_int8_gap.py` measures each of these, per layer and per seed.
`int8_gemm_saturates()` tells whether this CPU saturates; the engine logs a warning at start
and `describe` names the kernel of every layer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from qarl.model.decoder import CausalLM
from qarl.quant import quant_layers
from qarl.rollout.engine import left_pad, response_budget
from qarl.rollout.sampling import row_seed
from qarl.rollout.vllm_support import FLOAT32_ON_AMX, KERNEL_AMX, int8_gemm_saturates, resolve_dtype
from qarl.rollout.vllm_weights import (
    INT8_METHODS, default_dtype, install_checkpoint_tensors, int8_layers_needing_16bit,
    int8_method, int8_readback, quiet_vllm_reload, served_model, shutdown_llm, take_layer,
    write_policy_folder,
)
from qarl.types import FINISH_LENGTH, FINISH_STOP, RolloutBatch, SamplingParams

KV_CACHE_BYTES = 256 * 2**20  # RL batches of short responses fit many times over
log = logging.getLogger(__name__)


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
    `qarl.rollout.Engine`. `model` is the engine's qarl copy (`qarl.train.policy.engine_copy`);
    `folder` is where the starting policy is written for vLLM to load. eos / pad / max_context
    as for `LocalEngine`. `dtype`: what vLLM computes in, "auto" (float32 where its kernels
    take it, else bfloat16: `qarl.rollout.vllm_support`), "float32" or "bfloat16"; float32
    where an int8 layer's kernel needs 16-bit activations raises ValueError. vLLM runs in this
    process (VLLM_ENABLE_V1_MULTIPROCESSING=0 is set), eager (no compilation: seconds to
    start), with a small KV cache (`kv_cache_bytes`, raised to what one request of
    `max_context` tokens needs)."""

    stop_check = staticmethod(lambda: None)  # vLLM's generate runs to its end; see LocalEngine

    def __init__(self, model: CausalLM, folder: Path, eos_token_ids: Sequence[int] | None = None,
                 pad_token_id: int = 0, max_context: int | None = None, seed: int = 0,
                 kv_cache_bytes: int = KV_CACHE_BYTES, dtype: str = "auto"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model object stays reachable
        from vllm import LLM

        self.model = model
        self.eos_token_ids = tuple(
            model.config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.pad_token_id = pad_token_id
        self.max_context = (model.config.max_position_embeddings if max_context is None
                            else max_context)
        self.dtype = self._choose_dtype(dtype)
        self.folder = write_policy_folder(model, Path(folder))
        c = model.config  # vLLM refuses to start unless one request of max_context fits
        per_token = (2 * c.num_layers * c.num_kv_heads * c.head_dim
                     * getattr(torch, self.dtype).itemsize)  # K and V bytes
        kv_cache_bytes = max(kv_cache_bytes, int(1.25 * per_token * self.max_context))
        with _global_rng_kept():
            self.llm = LLM(model=str(self.folder), skip_tokenizer_init=True, enforce_eager=True,
                           dtype=self.dtype, seed=seed, logprobs_mode="processed_logprobs",
                           max_model_len=self.max_context, kv_cache_memory_bytes=kv_cache_bytes)
        self.last_sync_seconds = 0.0
        log.info("vLLM serves the policy in %s: %s", self.dtype, self.describe()["vllm"])
        saturating = self.saturating_int8_layers()
        if saturating:
            log.warning(
                "vLLM runs %d int8 layers (first: %s) on oneDNN's int8 GEMM, which saturates "
                "pair sums at int16 on this CPU (no VNNI): its outputs differ from qarl's exact "
                "int8 products by up to ~1e-1 relative and its logprobs from the learner's by "
                "tenths of a nat (SmolLM2-135M). Use a CPU with VNNI/AMX or CUDA for int8 "
                "rollouts that follow the learner's arithmetic, or rollout.engine = 'local'",
                len(saturating), saturating[0])

    def _choose_dtype(self, requested: str) -> str:
        """`requested`, or auto's choice; refuse float32 where an int8 layer would run on a
        kernel that takes only 16-bit activations (asked of vLLM's own dispatch rule)."""
        master = str(self.model.model.embed_tokens.weight.dtype).removeprefix("torch.")
        needs_16bit = int8_layers_needing_16bit(self.model)
        if requested == "float32" and needs_16bit:
            raise ValueError(f"VLLMEngine(dtype='float32'): {len(needs_16bit)} int8 layers "
                             f"(first: {needs_16bit[0]}): {FLOAT32_ON_AMX}")
        return resolve_dtype(requested, master, bool(needs_16bit))

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
        if not sampling.greedy and (sampling.temperature != 1.0 or sampling.truncates):
            raise ValueError(
                f"VLLMEngine.score computes vLLM's prompt logprobs, the raw log-softmax, which "
                f"is the sampler's distribution only for greedy decoding or temperature 1 "
                f"without truncation; got temperature={sampling.temperature}, "
                f"top_k={sampling.top_k}, top_p={sampling.top_p}, min_p={sampling.min_p}. "
                f"Score with a LocalEngine "
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

    def load_weights(self, state: dict, partial: bool = False) -> None:
        """Install `state` in the qarl copy (`qarl.quant.load_state`: names, schemes and
        shapes checked), then push the copy's codes and tensors into vLLM. The seconds it took
        are kept in `last_sync_seconds`. Whole states only: LoRA adapters (a partial state)
        are refused, as the recipe check refuses lora.rank > 0 with this engine."""
        from qarl.export import ct_state
        from qarl.quant import export_state, load_state

        if partial:
            raise NotImplementedError(
                "the vLLM engine takes whole weight states: qarl cannot push LoRA adapters into "
                "vLLM's layers (use rollout.engine = 'local' for a LoRA run)")
        start = time.perf_counter()
        with torch.no_grad():
            load_state(self.model, state)
        tensors = ct_state(export_state(self.model))
        vllm_model = self._vllm_model()
        quantized = {name: layer for name, layer in vllm_model.named_modules()
                     if hasattr(layer, "scheme")}
        packed = getattr(vllm_model, "packed_modules_mapping", {})
        layer_tensors = {name: take_layer(tensors, name, packed) for name in quantized}
        with quiet_vllm_reload():
            self.llm.collective_rpc("reload_weights",
                                    kwargs={"weights_iterator": iter(list(tensors.items()))})
        with torch.no_grad(), default_dtype(getattr(torch, self.dtype)):
            for name, layer in quantized.items():
                install_checkpoint_tensors(layer, layer_tensors[name])
        self.last_sync_seconds = time.perf_counter() - start

    def delta_loader(self) -> None:
        """None: whole states only. vLLM's CPU int8 layers hand their codes to oneDNN, which
        repacks a layer's whole weight (`process_weights_after_loading`); a delta could patch
        the qarl copy, but every layer whose codes changed would still be converted and
        repacked whole, and after a step nearly every layer has a changed code."""
        return None

    def qweights(self) -> dict:
        """The codes and scales of the qarl copy, which are the ones vLLM serves
        (`Engine.qweights`)."""
        return {name: layer.qweight() for name, layer in quant_layers(self.model).items()}

    def weight_digests(self) -> list[dict[str, tuple[int, ...]]]:
        """`Engine.weight_digests` of the qarl copy, whose checkpoint-format tensors every
        push hands to vLLM (`load_weights`), with vLLM's own int8 layers read back
        (`int8_readback`: the codes and scales vLLM still keeps as parameters compared with
        the copy's; a part that differs gets the digest -1, so the check names it). What
        cannot be read back (codes inside oneDNN's handles, other formats' repacked
        operands) shows in the mismatch budget instead."""
        from qarl.quant.digests import CODES_SUFFIX, engine_digests

        digests = engine_digests(self.model)
        for layer, (same_codes, same_scales) in int8_readback(self.llm, self.model).items():
            key = layer + ".weight" + CODES_SUFFIX
            codes, scales, *rest = digests[key]  # QWEIGHT_PARTS order
            digests[key] = (-1 if same_codes is False else codes,
                            -1 if same_scales is False else scales, *rest)
        return [digests]

    def release_caches(self) -> None:
        """Nothing is rebuilt per weight version outside vLLM's own weights, which the next
        load_weights overwrites in place."""

    def close(self) -> None:
        """Shut vLLM down now (idempotent). Its distributed state (the model-parallel groups)
        is process-wide, and vLLM tears it down when an in-process engine is garbage
        collected, which can be long after the engine was dropped (vLLM freezes the heap at
        every engine start): left to the collector, an old engine's teardown can come while
        a newer one runs and take that one's groups with it. Close an engine before starting
        another in the same process."""
        shutdown_llm(self.llm)

    def describe(self) -> dict[str, str]:
        """"vllm": the dtype vLLM computes in and why; per vLLM module with weights: its class
        and, when quantized, the compressed-tensors scheme, the kernel class vLLM picked and,
        for int8 layers on the CPU build, what that kernel computes (`vllm_support`)."""
        out = {"vllm": self._dtype_note()}
        for name, module in self._vllm_model().named_modules():
            scheme = getattr(module, "scheme", None)
            if scheme is not None:
                kernel = getattr(scheme, "kernel", scheme)
                out[name] = (f"vLLM {type(module).__name__}, {type(scheme).__name__} on "
                             f"{type(kernel).__name__}")
                method = int8_method(kernel)
                if method is not None:
                    out[name] += f" ({INT8_METHODS[method]()})"
            elif name.endswith(("lm_head", "embed_tokens")):
                out[name] = f"vLLM {type(module).__name__}, unquantized, {self.dtype}"
        return out

    def saturating_int8_layers(self) -> list[str]:
        """vLLM's layers that run the CPU oneDNN int8 GEMM, when that GEMM saturates on this
        CPU (`int8_gemm_saturates`); [] otherwise."""
        if not int8_gemm_saturates():
            return []
        return [name for name, module in self._vllm_model().named_modules()
                if int8_method(getattr(getattr(module, "scheme", None), "kernel", None))
                == "_apply_weights_onednn"]

    def _dtype_note(self) -> str:
        amx = [name for name, module in self._vllm_model().named_modules()
               if int8_method(getattr(getattr(module, "scheme", None), "kernel", None))
               == "_apply_weights_sgl"]
        if self.dtype == "float32":
            return "vLLM in float32, the learner's precision"
        master = self.model.model.embed_tokens.weight.dtype
        why = (f"{len(amx)} int8 layers run vLLM's {KERNEL_AMX}" if amx
               else "the model's weights are bfloat16" if master == torch.bfloat16
               else "as asked")
        return (f"vLLM in {self.dtype} ({why}): its activations, attention, norms and lm_head "
                f"round to {self.dtype}, where a fake or naive learner computes in fp32")

    # ---- helpers ----------------------------------------------------------------------------

    def _params(self, sampling: SamplingParams, budget: int, seed: int):
        from vllm import SamplingParams as VllmParams

        stops = sorted({*self.eos_token_ids, *sampling.stop_token_ids})
        common = dict(max_tokens=budget, logprobs=0, seed=seed, stop_token_ids=stops,
                      ignore_eos=True, detokenize=False)
        if sampling.greedy:
            return VllmParams(temperature=0.0, **common)
        # vLLM's top_k 0 and -1 both mean off; it returns no kept sets, so a run that
        # truncates with it needs rollout.truncation_correction = false (config checks)
        return VllmParams(temperature=sampling.temperature, top_p=sampling.top_p,
                          top_k=sampling.top_k, min_p=sampling.min_p, **common)

    def _run(self, prompts: list[list[int]], params: list) -> list:
        from vllm.inputs import TokensPrompt

        with _global_rng_kept():
            return self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                     use_tqdm=False)

    def _vllm_model(self) -> torch.nn.Module:
        return served_model(self.llm)

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
