"""CPU decode speed: run plain fp32 `nn.Linear` layers on oneDNN-prepacked weights.

Decoding multiplies a few rows (the batch) by every weight matrix once per step, so the step
time is the GEMM time. `F.linear` hands the weight to MKL in its stored layout, which re-lays
it out on every call; a weight reordered once into oneDNN's blocked layout skips that. Measured
on the 2-core AVX2 development machine for a [16, 1024] x [1024, 3072] product: 1.67 ms with
`F.linear`, 1.09 ms prepacked (M=1: 0.41 vs 0.21 ms).

`LinearPrepacker.applied(model)` swaps the forward of the packable layers for the block and
restores them on exit. Packed copies are kept between calls and checked against the weight's
storage and in-place version counter on every entry, so updated weights
(`LocalEngine.load_weights`, an optimizer step on a shared model) are never served stale.
Only modules whose type is exactly `nn.Linear` with an fp32 CPU weight are touched: quantized
layers, bf16 layers (oneDNN's bf16 path needs AVX512-BF16 or AVX-NE-CONVERT) and accelerator
tensors keep their own forward.
The products differ from `F.linear` by rounding only (~1e-6 relative in fp32).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn


def prepack_available(device: torch.device) -> bool:
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


def _packable(module: nn.Module) -> bool:
    return (
        type(module) is nn.Linear
        and module.weight.dtype == torch.float32
        and module.weight.device.type == "cpu"
        and "forward" not in module.__dict__  # already patched by someone: leave it alone
    )


def _packed_linear(packed: Tensor, bias: Tensor | None, x: Tensor) -> Tensor:
    # x: [..., in] float32 -> [..., out]; packed: oneDNN-blocked [out, in]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class LinearPrepacker:
    """Keeps a oneDNN-packed copy of each packable `nn.Linear` weight of a model, reused
    across calls while the weight is unchanged (same storage, same in-place version counter),
    repacked after any in-place update or replacement. Costs one extra copy of those weights
    in memory; packing the 109M config takes ~0.3 s on the development machine."""

    def __init__(self):
        self._packs: dict[nn.Module, tuple[tuple, Tensor]] = {}

    @contextmanager
    def applied(self, model: nn.Module, batch_hint: int):
        """Within the block, every packable `nn.Linear` of `model` computes with its packed
        weight (laid out for about `batch_hint` rows when first packed)."""
        packs: dict[nn.Module, tuple[tuple, Tensor]] = {}
        if prepack_available(next(model.parameters()).device):
            for module in model.modules():
                if _packable(module):
                    packs[module] = self._pack(module, batch_hint)
        self._packs = packs  # modules no longer packable (e.g. quantized since) are dropped
        for module, (_, packed) in packs.items():
            module.forward = partial(_packed_linear, packed, module.bias)
        try:
            yield
        finally:
            for module in packs:
                del module.forward  # back to nn.Linear.forward

    def _pack(self, module: nn.Linear, batch_hint: int) -> tuple[tuple, Tensor]:
        weight = module.weight
        # Inference tensors have no version counter: their in-place updates are invisible,
        # so they are repacked on every call.
        version = None if weight.is_inference() else weight._version
        key = (weight.data_ptr(), version, tuple(weight.shape))
        cached = self._packs.get(module)
        if version is not None and cached is not None and cached[0] == key:
            return cached
        return key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
