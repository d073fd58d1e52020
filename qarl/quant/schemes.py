"""The format registry `SCHEMES` (`register_scheme` adds a format), `make_scheme`, and the
full-precision format (the 8-bit ones live in `schemes_8bit.py`, the 4-bit ones in
`schemes_4bit.py`, the shared contract in `scheme_base.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qarl import native as nat
from qarl.quant.qweight import QWeight
from qarl.quant.scheme_base import Scheme
from qarl.quant.schemes_4bit import Int4Scheme, Nvfp4Scheme, W4A8Scheme
from qarl.quant.schemes_8bit import Fp8BlockScheme, Fp8Scheme, Int8Scheme

__all__ = [
    "SCHEMES", "Scheme", "make_scheme", "register_scheme", "scheme_options", "unregister_scheme",
]


@dataclass(frozen=True)
class NoneScheme(Scheme):
    """Full precision: linear is the batch-invariant GEMM on the weight itself.
    QWeight: codes [N, K] in the master dtype (a copy of the weight); no scales."""

    name = "none"
    row_separable = True
    is_identity = True

    def quantize(self, w: Tensor) -> QWeight:
        self.check_weight(w)
        return QWeight(self.name, tuple(w.shape), w.detach().clone())

    def dequantize(self, qw: QWeight) -> Tensor:
        return qw.codes.float()

    def act_qdq(self, x: Tensor) -> Tensor:
        return x.float()

    def matmul(self, x: Tensor, qw: QWeight) -> Tensor:
        return self.float_gemm(x, qw, lambda: qw.codes)

    def native_operand(self, qw: QWeight, device: torch.device) -> tuple[nat.GemmKind, object] | None:
        if not self.native_f32_ok(device, qw):
            return None
        return nat.GemmKind.F32, self.native_f32(qw, device, lambda: qw.codes)

    def native_f32_ok(self, device: torch.device, qw: QWeight) -> bool:
        # the weight is the master weight itself: the fp32 kernel takes an fp32 one only
        return super().native_f32_ok(device, qw) and qw.codes.dtype == torch.float32

    def kernel_path(self, device: torch.device, qw: QWeight) -> str:
        return f"{self.float_gemm_path(device, qw)} in the weight's dtype: no quantization"


class _Registry(dict):
    def __missing__(self, key):
        raise KeyError(f"unknown quantization scheme {key!r}; valid: {sorted(self)}")


SCHEMES: dict[str, Scheme] = _Registry({
    "none": NoneScheme(),
    "w8a8-int8": Int8Scheme(),
    "w8a8-fp8": Fp8Scheme(),
    "w8a8-fp8-block": Fp8BlockScheme(),
    "w4a16-int4": Int4Scheme(),
    "w4a16-nvfp4": Nvfp4Scheme(),
    "w4a8-int": W4A8Scheme(),
})


_REQUIRED = ("quantize", "dequantize", "act_qdq", "matmul", "kernel_path")


def register_scheme(scheme: Scheme) -> Scheme:
    """Add a format: `SCHEMES[scheme.name] = scheme` (an instance with its default options),
    after which every verb that takes a scheme name knows it (`quantize_model`, `make_scheme`,
    `load_state` of its QWeights, the engine, a recipe's `quant.scheme`). Returns `scheme`.
    Raises if it is not a `Scheme` defining the five required methods, or if its name is taken.
    """
    cls = type(scheme)
    if not isinstance(scheme, Scheme):
        raise TypeError(f"register_scheme expects a Scheme instance, got {cls.__name__}; "
                        f"subclass qarl.quant.Scheme (see qarl/quant/README.md)")
    missing = [m for m in _REQUIRED if getattr(cls, m) is getattr(Scheme, m)]
    if missing or scheme.name == Scheme.name:
        raise TypeError(f"{cls.__name__} must set a class attribute `name` (got "
                        f"{scheme.name!r}) and define {list(_REQUIRED)}; missing {missing}")
    if scheme.name in SCHEMES:
        raise ValueError(f"a scheme named {scheme.name!r} is already registered "
                         f"({type(SCHEMES[scheme.name]).__name__}); choose another name, or "
                         f"unregister_scheme({scheme.name!r}) first")
    SCHEMES[scheme.name] = scheme
    return scheme


def unregister_scheme(name: str) -> Scheme:
    """Remove the format `name` from SCHEMES (the inverse of `register_scheme`); returns it."""
    scheme = SCHEMES[name]  # unknown names raise with the valid list
    del SCHEMES[name]
    return scheme


def make_scheme(name: str | Scheme, **options) -> Scheme:
    """SCHEMES[name] with `options` (e.g. group_size=128, symmetric=False) replacing defaults."""
    if isinstance(name, Scheme):
        base = name
    else:
        base = SCHEMES[name]
    valid = base.options()
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise TypeError(f"scheme {base.name!r} has no option(s) {unknown}; valid: {sorted(valid)}")
    return type(base)(**{**valid, **options}) if options else base


def scheme_options(name: str) -> dict:
    """{option: default} that make_scheme(name, **options) accepts (for config validation)."""
    return SCHEMES[name].options()

