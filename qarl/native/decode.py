"""The per-token operations of decoding around the GEMMs: attention steps, RMSNorm, SwiGLU,
sampling, and a whole decoder block in one call (`DecodeBlock`)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from enum import IntEnum

import torch
from torch import Tensor

from qarl.native.ffi import _lib, _ptr, _rows, _threads
from qarl.native.gemm import PackedF32, PackedS8, PackedU4


def _step_args(what: str, B: int, Hkv: int, D: int, cos: Tensor, sin: Tensor, k_cache: Tensor,
               v_cache: Tensor, slot: int, mask: Tensor | None) -> tuple:
    """The arguments a one-token step takes after its own (cos, sin and their row stride; the
    caches, their strides and the slot; the mask and its row stride), checked."""
    if (k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride()
            or tuple(k_cache.shape[:2]) != (B, Hkv) or k_cache.shape[3] != D
            or slot >= k_cache.shape[2]
            or cos.shape[-1] != D or cos.stride(-1) != 1 or sin.stride() != cos.stride()):
        raise ValueError(
            f"{what}: cache {tuple(k_cache.shape)} strides {k_cache.stride()}, cos "
            f"{tuple(cos.shape)}, slot {slot}: expects a [{B}, {Hkv}, S_max, {D}] cache (unit "
            f"stride along D, v like k) with room for the slot, and cos / sin rows of {D}"
        )
    m_sb = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    return (cos.data_ptr(), sin.data_ptr(), cos.stride(0) if cos.shape[0] > 1 else 0,
            k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), slot, _ptr(mask), m_sb)


def decode_attention(qkv: Tensor, num_heads: int, num_kv_heads: int, cos: Tensor, sin: Tensor,
                     k_cache: Tensor, v_cache: Tensor, slot: int, mask: Tensor | None,
                     q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                     eps: float = 0.0) -> Tensor:
    """A decoder layer's attention for one new token per sequence, from its q/k/v projection:

    qkv [B, 1, (H + 2 Hkv) D] float32 (q heads, then k, then v) -> q and k per-head RMSNorm
    with weights q_norm / k_norm [D] (Qwen3; None: none) -> RoPE with cos / sin [B or 1, 1, 1,
    D] -> k, v written into k_cache / v_cache [B, Hkv, S_max, D] (this layer's cache, unit
    stride along D) at `slot` -> [B, 1, H D]: the attention of q over slots 0..slot, keys where
    mask [B or 1, slot + 1] (uint8, 1 = may attend) is 0 skipped (None: all).

    The same math as `Attention.forward` at T = 1 with a KVCache: RoPE to the bit (two rounded
    products and a sum, as PyTorch), the norms and the attention to fp32 rounding.
    """
    B, T, W = qkv.shape
    H, Hkv = num_heads, num_kv_heads
    D = W // (H + 2 * Hkv)
    if (T != 1 or W != (H + 2 * Hkv) * D or D % 8 or H % Hkv or qkv.dtype != torch.float32
            or not qkv.is_contiguous()):
        raise ValueError(
            f"decode_attention: qkv {tuple(qkv.shape)} {qkv.dtype} with {H} + 2 x {Hkv} heads: "
            f"expects one contiguous float32 token per sequence, D % 8 == 0, H % Hkv == 0"
        )
    step = _step_args("decode_attention", B, Hkv, D, cos, sin, k_cache, v_cache, slot, mask)
    q_buf = torch.empty(B, H, D, dtype=torch.float32)
    out = torch.empty(B, 1, H * D, dtype=torch.float32)
    _lib().qarl_decode_attention(qkv.data_ptr(), B, H, Hkv, D, _ptr(q_norm), _ptr(k_norm), eps,
                                 *step, D ** -0.5, q_buf.data_ptr(), out.data_ptr(), _threads())
    return out


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """x [..., N] float32 -> RMSNorm of each row (x / sqrt(mean(x^2) + eps), times weight [N]
    when given), as `qarl.model.decoder.RMSNorm` computes it, to fp32 rounding (its own
    summation order): [..., N] float32."""
    n = x.shape[-1]
    x2 = _rows(x, torch.float32, n, "rms_norm")
    if weight is not None and (weight.dtype != torch.float32 or weight.shape != (n,)):
        raise ValueError(f"rms_norm: weight must be float32 [{n}], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    y = torch.empty(x2.shape, dtype=torch.float32)
    _lib().qarl_rms_norm(x2.data_ptr(), x2.shape[0], n, n, _ptr(weight), eps, y.data_ptr(), n,
                         _threads())
    return y.view(x.shape)


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [..., 2F] float32 (gate columns first) -> silu(gate) * up: [..., F] float32
    (SwiGLU's product; silu to ~1 ulp of PyTorch's)."""
    f = gate_up.shape[-1] // 2
    g2 = _rows(gate_up, torch.float32, 2 * f, "silu_mul")
    y = torch.empty(g2.shape[0], f, dtype=torch.float32)
    _lib().qarl_silu_mul(g2.data_ptr(), g2.shape[0], f, y.data_ptr(), _threads())
    return y.view(*gate_up.shape[:-1], f)


def sample_rows(logits: Tensor, temperature: float, u: Tensor) -> Tensor:
    """One token per row of logits [B, V] float32 drawn from softmax(logits / temperature) by
    inverse CDF with the uniforms u [B] float64 in [0, 1): the first token whose cumulative
    probability exceeds u * total (probabilities exp(s - max s) in fp32 with their own exp,
    sums in fp64). Tokens with -inf logits are never drawn. -> [B] int64."""
    B, V = logits.shape
    if (logits.dtype != torch.float32 or logits.stride(-1) != 1 or u.shape != (B,)
            or u.dtype != torch.float64):
        raise ValueError(f"sample_rows: logits must be float32 [B, V] with unit stride along V "
                         f"and u float64 [B]; got {logits.dtype} {tuple(logits.shape)}, u "
                         f"{u.dtype} {tuple(u.shape)}")
    v8 = (V + 7) // 8 * 8
    p = torch.empty(B, v8, dtype=torch.float32)
    blocks = torch.empty(B, v8 // 8 + 1, dtype=torch.float64)
    tokens = torch.empty(B, dtype=torch.int64)
    u = u.contiguous()
    _lib().qarl_sample_rows(logits.data_ptr(), B, V, logits.stride(0), temperature, u.data_ptr(),
                            p.data_ptr(), blocks.data_ptr(), tokens.data_ptr(), _threads())
    return tokens


class GemmKind(IntEnum):
    """How a `DecodeBlock` runs one projection (the values are decode.c's GEMM_*). Which kind
    a layer has is the quantization scheme's answer (`Scheme.native_operand`), never a
    string matched here."""

    F32 = 0  # PackedF32: linear_f32
    S8 = 1  # PackedS8: W8A8, rows quantized per token as linear_s8_dynamic
    U4_BF16 = 2  # PackedU4 on bf16-rounded rows: linear_u4(x, w, round_bf16=True)
    U4_S8 = 3  # PackedU4 on the int8 codes of the rows, times their scales


@dataclass(frozen=True)
class BlockGemm:
    """One projection of a `DecodeBlock`: its kind, packed weight and bias [n] or None (added
    after)."""

    kind: GemmKind
    packed: PackedF32 | PackedS8 | PackedU4
    bias: Tensor | None = None


class _Gemm(ctypes.Structure):  # decode.c's qarl_gemm
    _fields_ = [("kind", ctypes.c_int32), ("group", ctypes.c_int32), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64), ("w", ctypes.c_void_p), ("s", ctypes.c_void_p),
                ("z", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Block(ctypes.Structure):  # decode.c's qarl_block
    _fields_ = [("qkv", _Gemm), ("o", _Gemm), ("gate_up", _Gemm), ("down", _Gemm),
                ("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("qn", ctypes.c_void_p),
                ("kn", ctypes.c_void_p), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
                ("qk_eps", ctypes.c_float), ("scale", ctypes.c_float), ("H", ctypes.c_int64),
                ("Hkv", ctypes.c_int64), ("D", ctypes.c_int64), ("d", ctypes.c_int64),
                ("ffn", ctypes.c_int64)]


def _f32_vector(t: Tensor | None, n: int, what: str) -> Tensor | None:
    if t is None:
        return None
    if t.shape != (n,):
        raise ValueError(f"DecodeBlock: {what} must have shape [{n}], got {tuple(t.shape)}")
    return t.detach().float().contiguous()


class DecodeBlock:
    """A decoder block (pre-norm attention with q/k/v stacked, SwiGLU MLP with gate/up stacked)
    run for one new token per sequence in ONE call, `qarl_decode_block`: every thread enters
    once and the steps meet at barriers, instead of eight calls (two RMSNorms, four GEMMs,
    `decode_attention`, `silu_mul`) each paying its Python wrapper, ctypes and the start of a
    parallel region. Each step is the function the separate calls run, so the result equals
    them bit for bit. Holds what its struct points to: copies of the norm weights and biases,
    and the caller's packed weights, which must not be modified in place while it is used."""

    def __init__(self, qkv: BlockGemm, o: BlockGemm, gate_up: BlockGemm, down: BlockGemm,
                 input_norm: Tensor, post_norm: Tensor, eps: tuple[float, float],
                 num_heads: int, num_kv_heads: int, head_dim: int,
                 q_norm: Tensor | None = None, k_norm: Tensor | None = None, qk_eps: float = 0.0):
        H, Hkv, D = num_heads, num_kv_heads, head_dim
        d, ffn = o.packed.n, down.packed.k
        shapes = {"qkv": (qkv, (H + 2 * Hkv) * D, d), "o": (o, d, H * D),
                  "gate_up": (gate_up, 2 * ffn, d), "down": (down, d, ffn)}
        for name, (g, n, k) in shapes.items():
            if not isinstance(g.kind, GemmKind) or (g.packed.n, g.packed.k) != (n, k):
                raise ValueError(f"DecodeBlock: {name} must be a {n} x {k} projection with a "
                                 f"GemmKind, got {g.kind!r} {g.packed.n} x {g.packed.k}")
        if D % 8 or H % Hkv or (q_norm is None) != (k_norm is None):
            raise ValueError(f"DecodeBlock: head_dim {D} must be a multiple of 8, {H} heads a "
                             f"multiple of {Hkv} key/value heads, q_norm and k_norm both given "
                             f"or neither")
        keep = [_f32_vector(input_norm, d, "input_norm"), _f32_vector(post_norm, d, "post_norm"),
                _f32_vector(q_norm, D, "q_norm"), _f32_vector(k_norm, D, "k_norm")]
        gemms = []
        for name, (g, n, _) in shapes.items():
            bias = _f32_vector(g.bias, n, f"{name} bias")
            keep.append(bias)
            w = g.packed
            scales, zeros = getattr(w, "scales", None), getattr(w, "zeros", None)
            gemms.append(_Gemm(int(g.kind), getattr(w, "group_size", 0), n, w.k,
                               w.data.data_ptr(), _ptr(scales), _ptr(zeros), _ptr(bias)))
        self._keep = (keep, qkv, o, gate_up, down)  # alive as long as the struct points at them
        self.num_heads, self.num_kv_heads, self.head_dim, self.hidden = H, Hkv, D, d
        self._struct = _Block(*gemms, *(_ptr(t) for t in keep[:4]), eps[0], eps[1], qk_eps,
                              D ** -0.5, H, Hkv, D, d, ffn)
        self._ref = ctypes.byref(self._struct)

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                 slot: int, mask: Tensor | None) -> Tensor:
        """x [B, 1, d] float32 -> the block's output [B, 1, d]; cos / sin, caches, slot and mask
        as `decode_attention` (the new k, v are written into the caches at `slot`)."""
        B, d = x.shape[0], self.hidden
        if x.dtype != torch.float32 or x.shape != (B, 1, d):
            raise ValueError(f"DecodeBlock: x {tuple(x.shape)} {x.dtype}: expects float32 "
                             f"[B, 1, {d}]")
        step = _step_args("DecodeBlock", B, self.num_kv_heads, self.head_dim, cos, sin, k_cache,
                          v_cache, slot, mask)
        out = x.clone(memory_format=torch.contiguous_format)  # updated in place by the call
        _lib().qarl_decode_block(self._ref, out.data_ptr(), B, *step, _threads())
        return out
