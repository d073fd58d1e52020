"""CPU decode speed: run fp32 decoder blocks on prepacked, fused weights.

Decoding multiplies a few rows (the batch) by every weight matrix once per step, so the step
time is the GEMM time plus a fixed cost per op. `F.linear` hands the weight to MKL in its
stored layout, which re-lays it out on every call; a weight packed once skips that. Packing
goes to `qarl.native` (24-column panels, an AVX2 kernel made for few-row products) where it
runs, else to oneDNN's blocked layout. Measured on the 2-core AVX2 development machine for a
[16, 1024] x [1024, 3072] product: 1.67 ms with `F.linear`, 1.1 ms oneDNN-packed, 0.85 ms
native (M=1: 0.41, 0.21, 0.19 ms).

`LinearPrepacker.applied(model)` swaps forwards for the block and restores them on exit:

- a decoder `Block` whose seven projections are all plain fp32 `nn.Linear` runs
  `fused_block_forward`: q/k/v as one GEMM on a concatenated packed weight and gate/up as
  another, q and k normalized (Qwen3) and rotated together, and both residual adds folded
  into the o_proj / down_proj GEMMs (native epilogue, or oneDNN post-ops). 7 GEMMs per block become 4 and ~7
  small ops per block per step go away; on a loaded machine each OpenMP region saved also
  saves a wait for a descheduled thread. (Folding silu and the up * silu product into the
  GEMMs as post-ops too was measured 2-10% slower per MLP than one gate/up GEMM followed by
  `silu(gate) * up` on the development machine.)
- a block whose seven projections are kernel-mode `QuantLinear`s of one row-separable format
  (int8, per-channel FP8, int4, w4a8: `Scheme.stack_rows`) runs the same fused forward with
  q/k/v and gate/up each as one quantized GEMM on row-stacked QWeights: exactly the layers'
  own outputs (each output row keeps its codes and scales; the activation is quantized once
  instead of three times, identically), at 4 kernel calls per block instead of 7.
- at each decode step (one token per sequence, fp32, a KV cache), a fused block whose four
  GEMMs are qarl.native kernels (fp32 panels, or a format's `Scheme.native_operand`) runs as
  ONE native call (`qarl.native.DecodeBlock`, built with the packs); other fused blocks run
  their steps with qarl.native's RMSNorm, SwiGLU product and one-call attention step.
- every other plain fp32 `nn.Linear` (lm_head, the linears of blocks that are partly
  quantized) runs on its own packed weight.

Packed copies are kept between calls and checked on every entry against the storage, the
in-place version counter and the shape of every parameter they were built from, so updated
weights (`LocalEngine.load_weights`, an optimizer step on a shared model) are never served
stale; quantized packs are keyed on the identity of each layer's installed QWeight. Only plain
fp32 CPU `nn.Linear` layers are packed; quantized layers always run their scheme's kernel
(stacked, in fused blocks), and bf16 layers (no bf16 arithmetic on this CPU) and accelerator
tensors keep their own forward. Results differ from the model's own forward by rounding
only (~1e-6 relative in fp32: GEMM summation order, the native RMSNorm and silu); two models
with identical weights compute identically on this path, which is what `LocalEngine.score`
relies on (the native kernels are also batch-invariant: a row's bits never depend on the
other rows).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn

from qarl import native
from qarl.model.decoder import MLP, Attention, Block, RMSNorm
from qarl.quant.linear import QuantLinear
from qarl.rollout.fused import BlockPacks, QuantPack, fused_block_forward, linear


def prepack_available(device: torch.device) -> bool:
    return device.type == "cpu" and (native.available() or torch.backends.mkldnn.is_available())


def _packable(module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and "forward" not in module.__dict__  # already patched by someone: leave it alone
    )


def _packed_linear(packed: Tensor, bias: Tensor | None, x: Tensor) -> Tensor:
    return linear(x, packed, bias)


def _pack(weight: Tensor, batch_hint: int):
    # [out, in] -> the same matrix in qarl.native's panels, else oneDNN's blocked layout for
    # about batch_hint rows
    if native.available():
        return native.pack_f32(weight.detach())
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)


def _version_key(tensors: list[Tensor]) -> tuple | None:
    """What identifies these tensors' values: storage, in-place version, shape. None when one
    is an inference tensor, which has no version counter (its updates are invisible)."""
    if any(t.is_inference() for t in tensors):
        return None
    return tuple((t.data_ptr(), t._version, tuple(t.shape)) for t in tensors)


def _block_linears(block: Block) -> list[nn.Module]:
    a, m = block.self_attn, block.mlp
    return [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]


def _stackable(module: nn.Module) -> bool:
    """A CPU QuantLinear in kernel mode whose format stacks rows exactly."""
    return (
        type(module) is QuantLinear and module.mode == "kernel"
        and module.weight.device.type == "cpu" and module.scheme.row_separable
        and "forward" not in module.__dict__
    )


def _block_kind(module: nn.Module) -> str | None:
    """"fp32" for a stock decoder block of plain fp32 linears, "quant" for one whose seven
    projections are stackable QuantLinears of one scheme, None otherwise (or when anything in
    it is patched or hooked)."""
    if not _stock_block(module):
        return None
    linears = _block_linears(module)
    # stacked projections: all of a stack with a bias, or none
    if not all(len({lin.bias is None for lin in stack}) == 1 for stack in _stacks(module)):
        return None
    if all(_packable(lin) for lin in linears):
        return "fp32"
    if all(_stackable(lin) for lin in linears) and len({lin.scheme for lin in linears}) == 1:
        return "quant"
    return None


def _stock_block(module: nn.Module) -> bool:
    if type(module) is not Block:
        return False
    attn, mlp = module.self_attn, module.mlp
    if type(attn) is not Attention or type(mlp) is not MLP:
        return False
    if attn.q_norm is not None and not (
        type(attn.q_norm) is RMSNorm and type(attn.k_norm) is RMSNorm
        and attn.q_norm.eps == attn.k_norm.eps
    ):
        return False
    if any(
        "forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks
        for m in module.modules()
    ):
        return False
    return True


def _stacks(block: Block) -> tuple[list[nn.Linear], list[nn.Linear]]:
    """The projections that share an input and run as one GEMM: q/k/v and gate/up."""
    a, m = block.self_attn, block.mlp
    return [a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj]


def _block_vectors(block: Block) -> list[Tensor]:
    """The norm weights and biases a block's packs copy (the native block holds them)."""
    a = block.self_attn
    norms = [block.input_layernorm, block.post_attention_layernorm, a.q_norm, a.k_norm]
    vectors = [n.weight for n in norms if n is not None]
    return vectors + [lin.bias for lin in _block_linears(block) if lin.bias is not None]


def _block_sources(block: Block) -> list[Tensor]:
    """The parameters the packs of a block are built from."""
    return [lin.weight for lin in _block_linears(block)] + _block_vectors(block)


def _stacked_bias(stack: list[nn.Module]) -> Tensor | None:
    # [sum of out] or None: the layers' biases side by side
    return None if stack[0].bias is None else torch.cat([lin.bias for lin in stack]).detach()


def _stacked(stack: list[nn.Linear], batch_hint: int) -> tuple[Tensor, Tensor | None]:
    # -> packed [sum of out, in], bias [sum of out] or None: the layers' outputs side by side
    return _pack(torch.cat([lin.weight for lin in stack]), batch_hint), _stacked_bias(stack)


def _quant_sources(block: Block) -> tuple:
    """What the packs of a quantized block are built from: each layer's current QWeight (held,
    compared by identity: a push installs new ones) and the stacked biases' versions."""
    qws = [lin.qweight() for lin in _block_linears(block)]
    vectors_key = _version_key(_block_vectors(block))
    return None if vectors_key is None else (_Same(qws), vectors_key)


class _Same:
    """Equal to another _Same holding the very same objects; holding them keeps ids unique."""

    def __init__(self, objects):
        self.objects = tuple(objects)

    def __eq__(self, other):
        return isinstance(other, _Same) and len(other.objects) == len(self.objects) and all(
            a is b for a, b in zip(self.objects, other.objects))


def _pack_quant_block(block: Block) -> BlockPacks:
    def stacked(stack):
        # -> the stack's QuantPack, its bias, and its native.BlockGemm (None: not native here)
        scheme = stack[0].scheme
        qw = stack[0].qweight() if len(stack) == 1 else scheme.stack_rows([lin.qweight() for lin in stack])
        device = qw.codes.device
        bias = _stacked_bias(stack)
        operand = scheme.native_operand(qw, device)
        gemm = None if operand is None else native.BlockGemm(*operand, bias)
        return QuantPack(scheme.bound(qw, device), qw.shape[0]), bias, gemm

    (qkv_stack, gate_up_stack), a, m = _stacks(block), block.self_attn, block.mlp
    stacks = (qkv_stack, [a.o_proj], gate_up_stack, [m.down_proj])
    qkv, o, gate_up, down = (stacked(s) for s in stacks)
    return BlockPacks(qkv=qkv[0], qkv_bias=qkv[1], o=o[0], gate_up=gate_up[0],
                      gate_up_bias=gate_up[1], down=down[0],
                      native=_native_block(block, qkv[2], o[2], gate_up[2], down[2]))


def _pack_block(block: Block, batch_hint: int) -> BlockPacks:
    a, m = block.self_attn, block.mlp
    (qkv, qkv_bias), (gate_up, gate_up_bias) = (_stacked(s, batch_hint) for s in _stacks(block))
    o, down = _pack(a.o_proj.weight, batch_hint), _pack(m.down_proj.weight, batch_hint)
    decode = None
    if isinstance(qkv, native.PackedF32):  # else oneDNN-packed: no native kernels here
        decode = _native_block(block, native.BlockGemm(native.GemmKind.F32, qkv, qkv_bias),
                               native.BlockGemm(native.GemmKind.F32, o, a.o_proj.bias),
                               native.BlockGemm(native.GemmKind.F32, gate_up, gate_up_bias),
                               native.BlockGemm(native.GemmKind.F32, down, m.down_proj.bias))
    return BlockPacks(qkv=qkv, qkv_bias=qkv_bias, o=o, gate_up=gate_up, gate_up_bias=gate_up_bias,
                      down=down, native=decode)


def _native_block(block: Block, qkv, o, gate_up, down) -> native.DecodeBlock | None:
    """The block as one qarl.native call (see BlockPacks.native), or None."""
    norms = (block.input_layernorm, block.post_attention_layernorm)
    if None in (qkv, o, gate_up, down) or any(type(n) is not RMSNorm for n in norms):
        return None
    a = block.self_attn
    if a.head_dim % 8:
        return None
    q_norm = k_norm = None
    qk_eps = 0.0
    if a.q_norm is not None:
        q_norm, k_norm, qk_eps = a.q_norm.weight, a.k_norm.weight, a.q_norm.eps
    return native.DecodeBlock(
        qkv, o, gate_up, down, norms[0].weight, norms[1].weight, (norms[0].eps, norms[1].eps),
        a.num_heads, a.num_kv_heads, a.head_dim, q_norm, k_norm, qk_eps)


class LinearPrepacker:
    """Keeps packed (and, per block, fused) copies of a model's plain fp32 linear
    weights, reused across calls while their source parameters are unchanged (same storage,
    in-place version and shape), rebuilt after any in-place update or replacement. Costs one
    extra copy of those weights in memory; packing the 109M config takes ~0.3 s on the
    development machine. fuse_blocks=False packs each linear on its own (no block fusion)."""

    def __init__(self, fuse_blocks: bool = True):
        self.fuse_blocks = fuse_blocks
        self._packs: dict[nn.Module, tuple[tuple | None, object]] = {}

    @contextmanager
    def applied(self, model: nn.Module, batch_hint: int):
        """Within the block, fusable decoder blocks run `fused_block_forward` and every other
        packable `nn.Linear` of `model` its packed weight (laid out for about `batch_hint`
        rows when first packed)."""
        packs: dict[nn.Module, tuple[tuple | None, object]] = {}
        if prepack_available(next(model.parameters()).device):
            fused: set[nn.Module] = set()
            if self.fuse_blocks:
                for module in model.modules():
                    kind = _block_kind(module)
                    if kind == "fp32":
                        key = _version_key(_block_sources(module))
                        build = partial(_pack_block, module, batch_hint)
                    elif kind == "quant":
                        key, build = _quant_sources(module), partial(_pack_quant_block, module)
                    else:
                        continue
                    packs[module] = self._cached(module, key, build)
                    fused.update(_block_linears(module))
            for module in model.modules():
                if module not in fused and _packable(module):
                    packs[module] = self._cached(
                        module, _version_key([module.weight]), partial(_pack, module.weight, batch_hint)
                    )
        self._packs = packs  # modules no longer packable (e.g. quantized since) are dropped
        for module, (_, packed) in packs.items():
            if isinstance(packed, BlockPacks):
                module.forward = partial(fused_block_forward, module, packed)
            else:
                module.forward = partial(_packed_linear, packed, module.bias)
        try:
            yield
        finally:
            for module in packs:
                del module.forward  # back to the class forward

    def _cached(self, module: nn.Module, key, build) -> tuple[object, object]:
        # key: what the pack was built from (None: unknowable, always rebuild)
        cached = self._packs.get(module)
        if key is not None and cached is not None and cached[0] == key:
            return cached
        return key, build()
