"""qarl's policy into vLLM's layers: the folder vLLM starts from, the per-layer tensors a
weight push installs, and what vLLM's CPU int8 kernels are (qarl/rollout/vllm_engine.py says
why each piece is needed). Imports vllm only inside the functions that touch its modules."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from qarl.model.decoder import CausalLM
from qarl.rollout.vllm_support import (
    INT8_SCHEME, KERNEL_AMX, KERNEL_ONEDNN_SATURATING, KERNEL_ONEDNN_VNNI, int8_gemm_saturates,
    is_x86,
)

# vLLM fuses these qarl layers into one (its packed_modules_mapping for Llama / Qwen)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


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


def take_layer(tensors: dict[str, Tensor], module: str, packed: dict) -> dict[str, Tensor]:
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


def install_checkpoint_tensors(layer: torch.nn.Module, tensors: dict[str, Tensor]) -> None:
    """Give a vLLM quantized layer fresh checkpoint-format parameters and let its scheme
    repack them (what loading a checkpoint does), so no state of the old weights survives."""
    for name, value in tensors.items():
        layer.register_parameter(name, torch.nn.Parameter(value.clone(), requires_grad=False))
    layer.scheme.process_weights_after_loading(layer)


@contextlib.contextmanager
def quiet_vllm_reload():
    """The quantized layers are left out of vLLM's reload on purpose; its per-layer "Failed to
    load weights" warnings would say otherwise."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


# vLLM's CPU int8 kernel methods (CPUInt8ScaledMMLinearKernel.linear_method) -> what they compute
INT8_METHODS = {
    "_apply_weights_sgl": lambda: KERNEL_AMX,
    "_apply_weights_onednn": lambda: (KERNEL_ONEDNN_SATURATING if int8_gemm_saturates()
                                      else KERNEL_ONEDNN_VNNI),
}


def int8_method(kernel) -> str | None:
    """The name of a vLLM CPU int8 kernel's chosen method, None for any other kernel."""
    name = getattr(getattr(kernel, "linear_method", None), "__name__", None)
    return name if name in INT8_METHODS else None


def int8_layers_needing_16bit(model: CausalLM) -> list[str]:
    """The vLLM layers (fused names: qkv_proj, gate_up_proj) of `model`'s int8 QuantLinears
    that vLLM's CPU build runs on its AMX kernel, which takes only 16-bit activations: vLLM's
    own rule (`check_cpu_sgl_kernel`, on x86) applied to each fused layer's shape."""
    if torch.cuda.is_available() or not is_x86():
        return []
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as vllm_cpu_mm

    from qarl.quant import quant_layers

    shapes: dict[str, tuple[int, int]] = {}  # vLLM layer -> (N, K)
    for name, layer in quant_layers(model).items():
        if layer.scheme.name != INT8_SCHEME:
            continue
        parent, _, leaf = name.rpartition(".")
        fused = next((f for f, parts in FUSED.items() if leaf in parts), leaf)
        n, _ = shapes.get(f"{parent}.{fused}", (0, 0))
        shapes[f"{parent}.{fused}"] = (n + layer.out_features, layer.in_features)
    return [name for name, (n, k) in shapes.items()
            if vllm_cpu_mm.check_cpu_sgl_kernel(n, k, torch.int8)]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """vLLM's int8 kernels size their output by the default dtype when they (re)pack a layer,
    which vLLM's loader sets to the model's dtype: so must a reload."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def served_model(llm) -> torch.nn.Module:
    """The torch module a `vllm.LLM` running in this process serves."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()


def shutdown_llm(llm) -> None:
    """Shut down a `vllm.LLM` running in this process now, not when the garbage collector takes
    it: vLLM's teardown destroys its process-wide model-parallel groups, which by then may be
    a newer engine's (VLLMEngine.close). A second call is a no-op (vLLM's client runs its
    finalizer once)."""
    llm.llm_engine.engine_core.shutdown()


def int8_layer_io(llm, prompts: list[list[int]]) -> dict[str, tuple[Tensor, Tensor]]:
    """(input, output), float32, of every int8 layer vLLM serves (fused names) on one prefill
    of `prompts`."""
    from vllm import SamplingParams as VllmParams
    from vllm.inputs import TokensPrompt

    seen, hooks = {}, []
    for name, module in served_model(llm).named_modules():
        if int8_method(getattr(getattr(module, "scheme", None), "kernel", None)) is not None:
            hooks.append(module.register_forward_hook(  # vLLM's linears return (out, bias)
                lambda m, a, o, name=name: seen.__setitem__(name, (_copy32(a[0]), _copy32(o[0])))))
    try:
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                     VllmParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def _copy32(t: Tensor) -> Tensor:
    """A float32 copy: vLLM rotates q and k in place after the qkv layer returns them."""
    return t.to(torch.float32, copy=True)


def fused_codes(qarl_model: CausalLM, vllm_layer: str) -> tuple[Tensor, Tensor]:
    """The int8 codes [N, K] and scales [N] of `qarl_model`'s layers behind one vLLM layer
    (q, k, v stacked for qkv_proj, as vLLM fuses them)."""
    parent, _, leaf = vllm_layer.rpartition(".")
    qws = [qarl_model.get_submodule(f"{parent}.{p}").qweight() for p in FUSED.get(leaf, (leaf,))]
    return torch.cat([w.codes for w in qws]), torch.cat([w.scales for w in qws])


def vllm_int8_codes(x: Tensor) -> tuple[Tensor, Tensor]:
    """vLLM's own dynamic per-token int8 quantizer: x [M, K] float32 -> (codes, scales [M, 1])."""
    x = x.contiguous()
    xq = torch.empty_like(x, dtype=torch.int8)
    xs = torch.empty(x.shape[0], 1)
    torch.ops._C.dynamic_scaled_int8_quant(xq, x, xs, None)
    return xq, xs


def int8_layer_errors(llm, qarl_model: CausalLM, prompts: list[list[int]]) -> dict[str, float]:
    """Per int8 layer vLLM serves, on one prefill of `prompts`: its output's relative error
    against the exact products of its own input (quantized by vLLM's per-token quantizer)
    with `qarl_model`'s codes and scales, ||y - (x_q w_q^T) s_x s_w|| / ||(x_q w_q^T) s_x s_w||
    in float64: fp32 rounding where vLLM's int8 sums are exact, far more where they saturate,
    bf16 rounding where vLLM runs in bfloat16 (benchmarks/vllm_int8_gap.py reports them)."""
    errors = {}
    for name, (x, y) in int8_layer_io(llm, prompts).items():
        wq, ws = fused_codes(qarl_model, name)
        xq, xs = vllm_int8_codes(x)
        ref = (xq.double() @ wq.double().T) * xs.double() * ws.double()[None]
        errors[name] = float((y.double() - ref).norm() / ref.norm())
    return errors


def int8_readback(llm, qarl_model: CausalLM) -> dict[str, tuple[bool | None, bool | None]]:
    """Read vLLM's int8 layers back: per qarl layer behind each vLLM int8 layer, whether the
    codes and the scales vLLM still holds as parameters equal the qarl copy's (q, k, v and
    gate, up stacked as vLLM fuses them); None for a part vLLM no longer keeps readable.
    vLLM 0.32's CPU int8 kernel keeps its fp32 per-channel scales (`weight_scale`) and hands
    the codes to oneDNN, which holds them in its own layout (no `weight` left): there the
    scales are checked and the codes are not. Layers with neither readable are left out."""
    out = {}
    for name, layer in served_model(llm).named_modules():
        if not hasattr(layer, "scheme") or getattr(layer, "weight_scale", None) is None:
            continue
        weight, scale = getattr(layer, "weight", None), layer.weight_scale
        codes, scales = fused_codes(qarl_model, name)
        same_codes = (torch.equal(weight.t(), codes) if weight is not None
                      and weight.dtype == torch.int8 and weight.t().shape == codes.shape
                      else None)
        same_scales = (torch.equal(scale.detach().reshape(-1).float(), scales.float())
                       if scale.numel() == scales.numel() else None)
        if same_codes is None and same_scales is None:
            continue
        parent, _, leaf = name.rpartition(".")
        for part in FUSED.get(leaf, (leaf,)):
            out[f"{parent}.{part}"] = (same_codes, same_scales)
    return out
