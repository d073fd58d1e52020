"""Packed weights for CPU decoding: what can be packed, how, and when a pack is stale.

Decoding multiplies a few rows (the batch) by every weight matrix once per step, so the step
time is the GEMM time plus a fixed cost per op. `F.linear` hands the weight to MKL in its
stored layout, which re-lays it out on every call; a weight packed once skips that. Packing
goes to `qarl.native` (24-column panels, a kernel made for few-row products: AVX2 tiles of 4
rows, AVX-512 tiles of 8 where the CPU has AVX-512F, the same bits) where it runs, else to
oneDNN's blocked layout. `benchmarks/quant_kernels.py --parts layers,f32` times the native
packed GEMM against `F.linear` at decode's row counts.

What is packed (`qarl.rollout.plan` decides which path each layer runs):

- `block_source`: a decoder `Block` whose seven projections are all plain fp32 `nn.Linear`
  gets `BlockPacks` for `fused_block_forward`: q/k/v as one packed weight and gate/up as
  another (7 GEMMs per block become 4). A block whose seven projections are kernel-mode
  `QuantLinear`s of one row-separable format (`Scheme.row_separable`: int8, per-channel FP8,
  int4, w4a8, none) gets the same packs as row-stacked QWeights run by the scheme's kernel
  (`Scheme.stack_rows`, `Scheme.bound`): exactly the layers' own outputs (each output row
  keeps its codes and scales; the activation is quantized once instead of three times,
  identically). Where all four GEMMs are qarl.native kernels (fp32 panels, or a format's
  `Scheme.native_operand`) and the norms are stock, the packs also hold the whole block as
  one native call for decode steps (`qarl.native.DecodeBlock`).
- A block whose seven projections are fake-mode `QuantLinear`s of one scheme (a `fake`
  learner's, replaying) gets packs whose GEMMs are its layers' own: the activation quantizer
  once per shared input, then `F.linear` on each layer's cached dequantized weight
  (`_fake_pack`: each layer's outputs bit for bit, no weight copied); what the fused block
  changes is the rest (qarl.native's RMSNorm, SwiGLU and one-call decode attention in place
  of many PyTorch ops and SDPA), to fp32 rounding. Measured by the old_logp phase of
  `benchmarks/step_time.py --arm fake:quant.align=fake`.
- `linear_source`: any other plain fp32 CPU `nn.Linear` (lm_head, the linears of blocks that
  are partly quantized or customized) gets its own packed weight.

Every pack comes with a key saying what it was built from: the storage, in-place version
counter and shape of every parameter it copies, and for quantized packs the identity of each
layer's installed QWeight. A pack whose key no longer matches is rebuilt, so updated weights
(`LocalEngine.load_weights`, an optimizer step on a shared model) are never served stale.
Quantized layers always run their scheme's kernel; bf16 layers (no bf16 arithmetic on this
CPU) and accelerator tensors are not packed. Packed GEMMs differ from `F.linear` by rounding
only (fp32 summation order); two models with identical weights compute
identically on them, which is what `LocalEngine.score` relies on (the native kernels are also
batch-invariant: a row's bits never depend on the other rows).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qarl import native
from qarl.model.decoder import MLP, Attention, Block, RMSNorm
from qarl.quant import QuantLinear
from qarl.rollout.fused import BlockPacks, QuantPack


def prepack_available(device: torch.device) -> bool:
    return device.type == "cpu" and (native.available() or torch.backends.mkldnn.is_available())


def packable(module: nn.Module) -> bool:
    """A plain fp32 CPU `nn.Linear` that nobody patched (no instance `forward`)."""
    return (
        type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and "forward" not in module.__dict__
    )


def pack_path(packed) -> str:
    """What runs a packed fp32 weight (for `LocalEngine.describe`)."""
    if isinstance(packed, native.PackedF32):
        return f"qarl.native fp32 GEMM ({native.f32_isa()}) on packed panels"
    return "oneDNN fp32 GEMM on a blocked weight"


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


def linear_source(linear: nn.Linear, batch_hint: int) -> tuple[tuple | None, Callable]:
    """(key, build) of a packable linear's packed weight (laid out for ~batch_hint rows)."""
    return _version_key([linear.weight]), partial(_pack, linear.weight, batch_hint)


def block_source(module: nn.Module, batch_hint: int) -> tuple[tuple | None, Callable] | None:
    """(key, build) of a fusable block's `BlockPacks`; None when `module` is not one (not a
    stock Block, patched or hooked, or its projections neither all plain fp32, nor all
    stackable QuantLinears of one scheme, nor all fake-mode QuantLinears of one scheme). A key
    of None means: always rebuild."""
    if not _stock_block(module):
        return None
    linears = block_linears(module)
    # stacked projections: all of a stack with a bias, or none
    if not all(len({lin.bias is None for lin in stack}) == 1 for stack in _stacks(module)):
        return None
    if all(packable(lin) for lin in linears):
        return _version_key(_block_sources(module)), partial(_pack_block, module, batch_hint)
    for kind, pack in ((_stackable, _pack_quant_block), (_fake_layer, _pack_fake_block)):
        if all(kind(lin) for lin in linears) and len({lin.scheme for lin in linears}) == 1:
            return _quant_sources(module), partial(pack, module)
    return None


def block_linears(block: Block) -> list[nn.Module]:
    a, m = block.self_attn, block.mlp
    return [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]


def _cpu_quant_layer(module: nn.Module, mode: str) -> bool:
    """A stock (unpatched) CPU QuantLinear in `mode`."""
    return (type(module) is QuantLinear and module.mode == mode
            and module.weight.device.type == "cpu" and "forward" not in module.__dict__)


def _stackable(module: nn.Module) -> bool:
    """A CPU QuantLinear in kernel mode whose format stacks rows exactly."""
    return _cpu_quant_layer(module, "kernel") and module.scheme.row_separable


def _fake_layer(module: nn.Module) -> bool:
    """A CPU QuantLinear in fake mode on an fp32 master weight (a `fake` learner's layer)."""
    return (_cpu_quant_layer(module, "fake") and not module.released
            and module.weight.dtype == torch.float32)


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
    return not any(
        "forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks
        for m in module.modules()
    )


def _stacks(block: Block) -> tuple[list[nn.Linear], list[nn.Linear]]:
    """The projections that share an input and run as one GEMM: q/k/v and gate/up."""
    a, m = block.self_attn, block.mlp
    return [a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj]


def _block_vectors(block: Block) -> list[Tensor]:
    """The norm weights and biases a block's packs copy (the native block holds them)."""
    a = block.self_attn
    norms = [block.input_layernorm, block.post_attention_layernorm, a.q_norm, a.k_norm]
    vectors = [n.weight for n in norms if n is not None]
    return vectors + [lin.bias for lin in block_linears(block) if lin.bias is not None]


def _block_sources(block: Block) -> list[Tensor]:
    """The parameters the packs of a block are built from."""
    return [lin.weight for lin in block_linears(block)] + _block_vectors(block)


def _stacked_bias(stack: list[nn.Module]) -> Tensor | None:
    # [sum of out] or None: the layers' biases side by side
    return None if stack[0].bias is None else torch.cat([lin.bias for lin in stack]).detach()


def _stacked(stack: list[nn.Linear], batch_hint: int) -> tuple[Tensor, Tensor | None]:
    # -> packed [sum of out, in], bias [sum of out] or None: the layers' outputs side by side
    return _pack(torch.cat([lin.weight for lin in stack]), batch_hint), _stacked_bias(stack)


def _quant_sources(block: Block) -> tuple | None:
    """What the packs of a quantized block are built from: each layer's current QWeight (held,
    compared by identity: a push installs new ones) and the stacked biases' versions."""
    qws = [lin.qweight() for lin in block_linears(block)]
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
    paths, below = [], []

    def stacked(stack):
        # -> the stack's QuantPack, its bias, and its native.BlockGemm (None: not native here)
        scheme = stack[0].scheme
        qw = stack[0].qweight() if len(stack) == 1 else scheme.stack_rows([lin.qweight() for lin in stack])
        device = qw.codes.device
        bias = _stacked_bias(stack)
        operand = scheme.native_operand(qw, device)
        gemm = None if operand is None else native.BlockGemm(*operand, bias)
        paths.append(scheme.kernel_path(device, qw))
        if scheme.native_rows(device) is not None:
            below.append(scheme.native_rows(device))
        return QuantPack(scheme.bound(qw, device), qw.shape[0]), bias, gemm

    (qkv_stack, gate_up_stack), a, m = _stacks(block), block.self_attn, block.mlp
    stacks = (qkv_stack, [a.o_proj], gate_up_stack, [m.down_proj])
    qkv, o, gate_up, down = (stacked(s) for s in stacks)
    return BlockPacks(qkv=qkv[0], qkv_bias=qkv[1], o=o[0], gate_up=gate_up[0],
                      gate_up_bias=gate_up[1], down=down[0],
                      native=_native_block(block, qkv[2], o[2], gate_up[2], down[2]),
                      native_below=min(below, default=None),
                      gemm_path="; ".join(dict.fromkeys(paths)))


def _fake_pack(stack: list[QuantLinear]) -> QuantPack:
    """Fake-mode layers that share an input, as one call: the scheme's activation quantizer
    once (row-wise, so the same rows each layer quantizes), then `F.linear` on each layer's own
    dequantized weight (cached per weight version, not copied), outputs side by side: each
    column block is that layer's `QuantLinear._fake` GEMM on the same operands, bit for bit."""
    act_qdq, weights = stack[0].scheme.act_qdq, [lin.dequantized() for lin in stack]

    def run(rows: Tensor) -> Tensor:  # [M, K] -> [M, sum of out]
        x = act_qdq(rows)
        outs = [F.linear(x, w) for w in weights]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    return QuantPack(run, sum(w.shape[0] for w in weights))


def _pack_fake_block(block: Block) -> BlockPacks:
    """A fake-mode block's packs: its GEMMs are its layers' own (`_fake_pack`); the norms,
    attention and SwiGLU those of the fused block (qarl.native's where they run)."""
    (qkv_stack, gate_up_stack), a, m = _stacks(block), block.self_attn, block.mlp
    return BlockPacks(qkv=_fake_pack(qkv_stack), qkv_bias=_stacked_bias(qkv_stack),
                      o=_fake_pack([a.o_proj]), gate_up=_fake_pack(gate_up_stack),
                      gate_up_bias=_stacked_bias(gate_up_stack), down=_fake_pack([m.down_proj]),
                      native=None, gemm_path=a.q_proj.kernel_path())


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
                      down=down, native=decode, gemm_path=pack_path(qkv))


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
