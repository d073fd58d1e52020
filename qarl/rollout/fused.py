"""The forward of a fused decoder block on packed weights (`fused_block_forward`), and the
packs it runs on (`BlockPacks`); `qarl.rollout.prepack` builds them and `qarl.rollout.plan`
caches them and makes this forward the layer's step in the engine's decode plan.

At each decode step (one fp32 token per sequence into a KV cache) a block whose packs carry a
`qarl.native.DecodeBlock` runs as that one native call; otherwise the steps below run, with
qarl.native's RMSNorm, SwiGLU product and one-call attention step where it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qarl import native
from qarl.model.decoder import Attention, Block, RMSNorm, apply_rope
from qarl.quant import run_rows


@dataclass(frozen=True)
class QuantPack:
    """Quantized projections that share an input, run in one call: rows stacked into one
    QWeight (exact: see `Scheme.stack_rows`) and `run` the scheme's kernel bound to it
    (`Scheme.bound`), or fake-mode layers' own GEMMs side by side (`prepack._fake_pack`);
    `n` the output size."""

    run: object  # rows [M, K] -> [M, n]
    n: int


def linear(x: Tensor, packed, bias: Tensor | None) -> Tensor:
    # x: [..., in] float32 -> x W^T + b: [..., out]; packed: native panels, QuantPack or oneDNN
    if isinstance(packed, native.PackedF32):
        return native.linear_f32(x, packed, bias)
    if isinstance(packed, QuantPack):
        return run_rows(packed.run, x, bias, packed.n)  # = scheme.linear(x, qweight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _linear_add(x: Tensor, residual: Tensor, packed, bias: Tensor | None) -> Tensor:
    # x W^T + b + residual, the add fused into the GEMM where the kernel can; residual like it
    if isinstance(packed, native.PackedF32):
        return native.linear_f32(x, packed, bias, residual)
    if isinstance(packed, QuantPack):
        return residual + run_rows(packed.run, x, bias, packed.n)
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")


@dataclass(frozen=True)
class BlockPacks:
    """Packed weights of one decoder block (hidden d, H query / Hkv key-value heads of D)."""

    # each weight packed [out, in]: qarl.native.PackedF32 panels, or oneDNN-blocked without it
    qkv: object  # [(H + 2 Hkv) D, d]: q_proj, k_proj, v_proj rows stacked
    qkv_bias: Tensor | None  # [(H + 2 Hkv) D] or None (Qwen2 only has q/k/v biases)
    o: object  # [d, H D]
    gate_up: object  # [2 ffn, d]: gate_proj, up_proj rows stacked
    gate_up_bias: Tensor | None  # [2 ffn] or None
    down: object  # [d, ffn]
    # the whole block in one native call for one token per sequence, or None where a
    # projection (or a norm) is not one qarl.native runs; used below `native_below` rows
    # (None: always), where a projection's other kernel computes the same bits faster
    native: native.DecodeBlock | None
    gemm_path: str  # what runs the GEMMs (a pack_path, or the scheme's kernel_path)
    native_below: int | None = None


def _rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    # RMSNorm.forward in one call for fp32: qarl.native's (F.rms_norm dispatches several ops,
    # whose overhead outweighs a decode row's arithmetic), else F.rms_norm (the same bits as
    # RMSNorm.forward)
    if type(norm) is not RMSNorm or x.dtype != torch.float32 or norm.weight.dtype != torch.float32:
        return norm(x)
    if native.available():
        return native.rms_norm(x, norm.weight.detach(), norm.eps)
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


def _swiglu(gate_up: Tensor) -> Tensor:
    # [..., 2 ffn] -> silu(gate) * up: [..., ffn]
    if native.available() and gate_up.dtype == torch.float32:
        return native.silu_mul(gate_up)
    ffn = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :ffn]) * gate_up[..., ffn:]


class _MaskBytes:
    """The attention mask of the current decode step as [B or 1, S] uint8 for the native
    attention, converted once per step (every layer gets the same mask object) instead of
    once per layer. Holds the mask it converted, so its identity cannot be reused."""

    def __init__(self):
        self.mask, self.bytes = None, None

    def __call__(self, mask: Tensor | None) -> Tensor | None:
        if mask is None:
            return None
        if mask is not self.mask:
            self.mask = mask
            self.bytes = mask.reshape(mask.shape[0], mask.shape[-1]).to(torch.uint8).contiguous()
        return self.bytes


_mask_bytes = _MaskBytes()


def _native_decode_ok(attn: Attention, x: Tensor, cache) -> bool:
    # one fp32 token per sequence into a KV cache, head size a multiple of 8: decode_attention
    return (x.shape[1] == 1 and cache is not None and x.dtype == torch.float32
            and cache.k.dtype == torch.float32 and attn.head_dim % 8 == 0 and native.available())


def _attention_decode(attn: Attention, qkv: Tensor, cos, sin, mask, cache, layer: int,
                      slot: int) -> Tensor:
    # qkv [B, 1, (H + 2 Hkv) D] -> [B, 1, H D]: norms, RoPE, cache write and attention in one call
    q_norm = k_norm = None
    eps = 0.0
    if attn.q_norm is not None:
        q_norm, k_norm = attn.q_norm.weight.detach(), attn.k_norm.weight.detach()
        eps = attn.q_norm.eps
    return native.decode_attention(
        qkv, attn.num_heads, attn.num_kv_heads, cos, sin, cache.k[layer], cache.v[layer], slot,
        _mask_bytes(mask), q_norm, k_norm, eps)


def fused_block_forward(
    block: Block, packs: BlockPacks, x, cos, sin, mask, cache, layer: int, cache_start: int
) -> Tensor:
    """`Block.forward` (same arguments, same math) on packed, fused weights. x: [B, T, d]."""
    attn, mlp = block.self_attn, block.mlp
    native_step = _native_decode_ok(attn, x, cache)
    if native_step and packs.native is not None and (
            packs.native_below is None or x.shape[0] < packs.native_below):
        # one token per sequence: the whole block in one call (= the steps below, bit for bit)
        return packs.native(x, cos, sin, cache.k[layer], cache.v[layer], cache_start,
                            _mask_bytes(mask))
    h = _rms_norm(block.input_layernorm, x)
    qkv = linear(h, packs.qkv, packs.qkv_bias)  # [B, T, (H + 2 Hkv) D]
    if native_step:
        out = _attention_decode(attn, qkv, cos, sin, mask, cache, layer, cache_start)  # [B, 1, H D]
    else:
        out = _attention(attn, qkv, cos, sin, mask, cache, layer, cache_start)
    # x + o_proj(attention), the residual add fused into the GEMM
    x = _linear_add(out, x, packs.o, attn.o_proj.bias)
    h = _rms_norm(block.post_attention_layernorm, x)
    gate_up = linear(h, packs.gate_up, packs.gate_up_bias)  # [B, T, 2 ffn]
    # SwiGLU: x + down(silu(gate(h)) * up(h)), the residual add fused into the GEMM
    return _linear_add(_swiglu(gate_up), x, packs.down, mlp.down_proj.bias)


def _attention(attn: Attention, qkv: Tensor, cos, sin, mask, cache, layer: int,
               cache_start: int) -> Tensor:
    # qkv [B, T, (H + 2 Hkv) D] -> attention output [B, T, H D] (PyTorch ops, SDPA)
    B, T, _ = qkv.shape
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    qk = qkv[..., : (H + Hkv) * D].unflatten(-1, (H + Hkv, D))  # [B, T, H + Hkv, D]
    if attn.q_norm is not None:
        # Qwen3 per-head RMSNorm of q and k in one pass, then each scaled by its own weight
        qk = F.rms_norm(qk, (D,), eps=attn.q_norm.eps)
        qk[:, :, :H].mul_(attn.q_norm.weight)
        qk[:, :, H:].mul_(attn.k_norm.weight)
    qk = apply_rope(qk.transpose(1, 2), cos, sin)  # [B, H + Hkv, T, D]: q and k rotated at once
    q, k = qk[:, :H], qk[:, H:]  # [B, H, T, D], [B, Hkv, T, D]
    v = qkv[..., (H + Hkv) * D :].unflatten(-1, (Hkv, D)).transpose(1, 2)  # [B, Hkv, T, D]
    if cache is not None:
        k, v = cache.update(layer, k, v, cache_start)  # [B, Hkv, S, D]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None and T > 1, enable_gqa=H != Hkv,
    )
    return out.transpose(1, 2).reshape(B, T, H * D)
