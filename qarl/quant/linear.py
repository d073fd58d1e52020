"""QuantLinear: an nn.Linear replacement whose forward runs a scheme, in one of two modes.

- `fake`:   y = F.linear(act_qdq(x), dequantize(quantize(W))) + b: the scheme's quantizers,
            floating-point matmul. Same primitives as `kernel`; only the matmul differs.
- `kernel`: y = scheme.linear(x, quantize(W)) + b: the engine's own kernel, bit for bit.
            With grad (a learner's gradient pass, whose logp value is never used: the exact
            replay gives it), a format whose kernel is an emulation or decode-shaped runs the
            `fake` forward instead, the same function up to rounding on a BLAS GEMM
            (`Scheme.kernel_for_gradients`; int8 keeps its int8 GEMM in an fp32 pass).
            In a bf16 pass (train.compute_dtype) every format's gradient forward is the bf16
            GEMM of x_hat and W_hat in bf16, W_hat dequantized once per weight version and
            x_hat made once per fused group (q/k/v, gate/up): a full-precision learner's
            bf16 pass, plus the quantizers.

Backward (both modes) is the straight-through estimator: quantizers count as identity,
so with x_hat = act_qdq(x) and W_hat = dequantize(quantize(W)):
    dL/dx = g W_hat,   dL/dW = g^T x_hat,   dL/db = sum_rows g
i.e. the gradient of F.linear(x_hat, W_hat) w.r.t. W_hat lands on the master weight W.
Where the kernel runs on activation codes computed outside it (`CodesPass.forward_codes`: W8A8
at 16+ rows through torch._int_mm, i.e. CUDA and CPUs with VNNI or AMX-INT8), the layer keeps
those codes instead of x and builds x_hat from them: the same x_hat, without a second
quantization, in a quarter of the memory; where qarl.native's kernel quantizes inside (an
AVX2-only CPU) it keeps x. Either way a layer whose gradient forward runs the kernel never
reads W_hat there and holds none: its backward makes it, one layer at a time.

With `backward = "codes"` (recipe train.quant_backward) the backward multiplies on codes
instead: dL/dx on the weight's int8 codes with g quantized per row where the format has it
(`CodesPass.grad_input`: no W_hat at all), dL/dW on the activation codes the forward kept
(`CodesPass.grad_weight`; a W4A16 layer keeps bf16(x), its kernel's input): the format's
optional capability, `Scheme.codes_pass()` (qarl/quant/codes.py).

Weights are quantized once per weight version: the cache key is (data_ptr, _version) of the
master weight, which every in-place optimizer update, `copy_` or `.to()` changes. Decoding
never re-quantizes; a training step re-quantizes exactly once, at the next forward.
`install(qw)` puts an already-quantized weight in the cache as-is (the engine side).
`release_master()` keeps only the codes and scales: an engine's copy that decodes and
receives QWeights never reads its full-precision weight, and an fp32 copy of every quantized
layer's weight would add to a run's peak memory (benchmarks/step_time.py --rounds records it).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qarl.quant import kernels as K
from qarl.quant.qweight import QWeight
from qarl.quant.scheme_base import run_rows
from qarl.quant.schemes import Scheme, make_scheme

MODES = ("fake", "kernel")
BACKWARDS = ("float", "codes")  # QuantLinear.backward
# The learner's alignment modes (recipe quant.align): a QuantLinear mode in the learner, or
# "naive", a plain full-precision learner beside the quantized engine.
ALIGNS = ("naive", "fake", "kernel")  # from no alignment to the exact one


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown QuantLinear mode {mode!r}; valid: {sorted(MODES)} (a layer "
                         f"meant to run in full precision stays an nn.Linear: leave it out of "
                         f"quantize_model's include)")
    return mode


def _compute_dtype(device: torch.device) -> torch.dtype:
    """The dtype a gradient pass on `device` multiplies in: autocast's where it is on
    (qarl.train.learner.precision), else float32."""
    kind = device.type  # autocast exists for cpu / cuda / ..., not for meta
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return torch.float32


class _STELinear(torch.autograd.Function):
    """Forward given by `fn(x2d)`; backward is the straight-through estimator onto W. Under
    autocast (qarl.train.learner.precision: the gradient pass in bf16) the backward's two GEMMs run in
    the autocast dtype, as autocast's own matmuls do, and `w_hat` comes in that dtype; the
    weight gradient lands in the master's dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, fn, x_hat_fn, w_hat, act, compute, on_codes):
        # x: [M, K]; weight: master [N, K] (only its grad slot is used); w_hat: [N, K] in the
        # backward's compute dtype, or a function that makes it there (a layer whose forward
        # runs on codes: its dequantized weight exists one layer at a time in the backward,
        # not for every layer through the step); act: what x_hat_fn(*act) builds x_hat from,
        # (x,) or the activation codes the forward's kernel ran on (CodesPass);
        # on_codes: (g -> dL/dx or None, (g, act) -> dL/dW or None), the products the backward
        # takes on codes (QuantLinear.backward "codes"; w_hat is None where dL/dx is one)
        ctx.grad_x_fn, ctx.grad_w_fn = on_codes
        ctx.held = isinstance(w_hat, Tensor)
        ctx.w_hat_fn = None if ctx.held else w_hat
        ctx.save_for_backward(*((w_hat,) if ctx.held else ()), *act)
        ctx.x_hat_fn, ctx.has_bias, ctx.dtypes = x_hat_fn, bias is not None, (x.dtype, weight.dtype)
        ctx.compute = compute
        return fn(x)

    @staticmethod
    def backward(ctx, grad):  # grad: [M, N]
        saved = ctx.saved_tensors
        w_hat, act = (saved[0], saved[1:]) if ctx.held else (None, saved)
        g = grad.to(ctx.compute)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0] and ctx.grad_x_fn is not None:
            grad_x = ctx.grad_x_fn(grad.float()).to(ctx.dtypes[0])  # from the codes
        elif ctx.needs_input_grad[0]:
            w_hat = w_hat if ctx.held else ctx.w_hat_fn()
            grad_x = K.learner_mm(g, w_hat).to(ctx.dtypes[0])  # dL/dx = g W_hat
            del w_hat  # one layer's at a time where it was made here
        if ctx.needs_input_grad[1]:
            if ctx.grad_w_fn is not None:
                grad_w = ctx.grad_w_fn(grad.float(), act).to(ctx.dtypes[1])  # on the codes
            else:
                x_hat = ctx.x_hat_fn(*act).to(ctx.compute)
                grad_w = K.learner_mm(g.t(), x_hat).to(ctx.dtypes[1])  # dL/dW = g^T x_hat
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad.float().sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


class QuantLinear(nn.Module):
    """Drop-in for nn.Linear: same `weight` [out, in] and `bias` [out] parameters (HF names)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, scheme: str | Scheme,
                 mode: str = "kernel"):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight  # the master weight; kept as the same Parameter (ties survive)
        self.bias = bias
        self.scheme = make_scheme(scheme)
        self.codes_pass = self.scheme.codes_pass()  # None: no gradient pass on codes
        self.mode = check_mode(mode)
        self._qweight: QWeight | None = None
        self._qweight_key: tuple | None = None
        # [N, K] by dtype: fp32 for fake mode and backward, bf16 for a bf16 backward
        self._dequantized: dict[torch.dtype, Tensor] = {}
        # What the straight-through backward multiplies (BACKWARDS; a learner's layers get
        # train.quant_backward resolved): "float", g with W_hat and x_hat in the compute
        # dtype; "codes", g with the weight's and the forward's activation codes
        # (`codes_pass`: qarl.quant.codes)
        self.backward = "float"
        self.quantize_count = 0  # how many times this layer quantized its master weight
        self.released = False  # the master weight's storage is gone (release_master)
        # The other layers of this one's fused group (q/k/v, gate/up; set by quantize_model):
        # a plain tuple, not submodules, so state_dict and named_modules do not see them twice.
        self.fused_peers: tuple[QuantLinear, ...] = ()
        # (x, x._version, x_hat) of the last 16-bit gradient forward, weakly (_fake_lowp)
        self._x_hat: tuple[weakref.ref, int, weakref.ref] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str | Scheme, mode: str = "kernel") -> "QuantLinear":
        return cls(linear.weight, linear.bias, scheme, mode)

    def _key(self) -> tuple:
        own = (self.weight.data_ptr(), self.weight._version)
        if not self._shares_scale():
            return own
        return (own, *((p.weight.data_ptr(), p.weight._version) for p in self.fused_peers))

    def _shares_scale(self) -> bool:
        return self.scheme.group_scaled and bool(self.fused_peers)

    def _quantize(self) -> QWeight:
        w = self.weight.detach()
        if not self._shares_scale():
            # a layer whose forward read the dequantized weight last version (a learner's)
            # gets it with the codes, in the format's one pass where it has one
            wants = torch.float32 in self._dequantized
            qw, full = self.scheme.quantize_dequantized(w, dequantized=wants)
            self._dequantized = {} if full is None else {torch.float32: full}
            return qw
        # max over the group of max|w|: the global scale every member quantizes with
        group_amax = torch.stack([w.float().abs().amax()] + [
            p.weight.detach().float().abs().amax().to(w.device) for p in self.fused_peers]).amax()
        self._dequantized = {}
        return self.scheme.quantize(w, group_amax)

    def qweight(self) -> QWeight:
        """The QWeight of the current master weight (quantized at most once per version); for
        a released layer, the last installed one."""
        if self.released:
            if self._qweight is None:
                raise RuntimeError(
                    f"{self.scheme.name} layer [{self.out_features} x {self.in_features}] has "
                    f"released its master weight and holds no codes; install a QWeight")
            return self._qweight
        key = self._key()
        if self._qweight is None or self._qweight_key != key:
            # normal tensors even when the engine decodes under torch.inference_mode, so a
            # shared learner model can later save them for backward
            with torch.inference_mode(False), torch.no_grad():
                self._qweight = self._quantize()  # resets the dequantized cache
            self._qweight_key = key
            self.quantize_count += 1
        return self._qweight

    def install(self, qw: QWeight) -> None:
        """Use `qw` as-is (no re-quantization) until the master weight changes."""
        if not self.scheme.matches(qw):
            raise ValueError(
                f"QWeight of scheme {qw.scheme!r} (group {qw.group_size}, symmetric "
                f"{qw.symmetric}) cannot go into a layer quantized with {self.scheme!r}; "
                f"quantize the engine model with the learner's scheme and options"
            )
        if tuple(qw.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"QWeight shape {tuple(qw.shape)} != layer shape "
                f"{(self.out_features, self.in_features)}"
            )
        self._qweight = qw.to(self.weight.device)
        self._qweight_key, self._dequantized = None if self.released else self._key(), {}

    def release_master(self, qw: QWeight | None = None) -> None:
        """Free the master weight's storage, keeping `qw` (default: the current weight's
        codes): `weight` becomes a zero-stride view of one zero (same shape, dtype and device,
        so state_dict names, devices and shapes are unchanged) and `qweight()` returns the
        installed codes from then on. For an engine's copy whose pushes are QWeights (aligned
        learners); a weight shared with another module (a tied lm_head) must not be released,
        and a fused group sharing one scale is released together (`release_masters`), since
        each member's codes depend on the others' weights."""
        qw = self.qweight() if qw is None else qw
        w = self.weight
        placeholder = torch.zeros((), dtype=w.dtype, device=w.device).expand(w.shape)
        self.weight = nn.Parameter(placeholder, requires_grad=False)
        self._qweight, self._qweight_key, self._dequantized, self.released = qw, None, {}, True

    def forget(self) -> None:
        """Drop the cached quantized weight: the next use quantizes the master weight again.
        For a change the (data_ptr, _version) key does not see: new fused peers (a new group
        scale), or master weights rewritten in a reused buffer (an FSDP-sharded learner's)."""
        if self.released:
            raise RuntimeError("forget: this layer released its master weight; it has nothing "
                               "to quantize again (install a QWeight instead)")
        self._qweight = self._qweight_key = None
        self._dequantized = {}

    def dequantized(self, dtype: torch.dtype = torch.float32) -> Tensor:  # [N, K]
        """The dequantized weight (fp32), or its copy in `dtype`, cached per weight version."""
        qw = self.qweight()
        if dtype not in self._dequantized:
            self._dequantized[dtype] = self._dequantize(qw, dtype)
        return self._dequantized[dtype]

    def _dequantize(self, qw: QWeight, dtype: torch.dtype) -> Tensor:  # [N, K], not cached
        """`qw` dequantized in `dtype`: from the cached fp32 copy where there is one for it,
        else anew (the backward of a layer whose forward ran on codes keeps no copy)."""
        with torch.inference_mode(False), torch.no_grad():
            full = self._dequantized.get(torch.float32) if qw is self._qweight else None
            return self.scheme.dequantize_to(qw, dtype) if full is None else full.to(dtype)

    def forward(self, x: Tensor) -> Tensor:  # x: [..., in] -> [..., out]
        qw = self.qweight()
        needs_grad = torch.is_grad_enabled() and (
            x.requires_grad or self.weight.requires_grad
            or (self.bias is not None and self.bias.requires_grad)
        )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        compute = _compute_dtype(x.device) if needs_grad else torch.float32
        # with grad, only a format whose kernel is the fast GEMM runs it (Scheme docstring)
        on_kernel = self.mode == "kernel" and (
            not needs_grad or self.scheme.kernel_for_gradients(x.device, compute))
        if on_kernel:
            fn = lambda t: self.scheme.linear(t, qw, self.bias)  # noqa: E731
        else:
            fn = lambda t: self._fake(t)  # noqa: E731
        if not needs_grad:
            y = fn(x2)
        elif compute != torch.float32 and not on_kernel and self.backward == "float":
            y = self._fake_lowp(x, x2, compute)
        else:
            cp = self.codes_pass
            codes = cp.forward_codes(x2.detach().float()) if on_kernel and cp is not None else None
            on_codes = self.backward == "codes" and cp is not None
            # what the backward keeps of x: the codes the kernel ran on, else (backward on
            # codes) the format's own form of x_hat where it has one, else x itself (often
            # the tensor the layer beside keeps too)
            kept = codes if codes is not None or not on_codes else cp.keep(x2.detach().float())
            if kept is None:
                act, x_hat_fn = (x2,), lambda t: self.scheme.act_qdq(t.float())
            else:  # 4x (int8) or 2x (bf16) smaller than x
                act, x_hat_fn = kept, lambda *c: cp.x_hat(c)
            if codes is not None:  # the kernel runs on the codes
                fn = lambda t: run_rows(lambda _: cp.matmul(codes, qw), t,  # noqa: E731
                                        self.bias, self.out_features)
            elif kept is not None and not on_kernel:
                # the fake forward on the kept codes: x_hat(kept) == act_qdq(x) bit for bit,
                # one quantization of x, not two
                fn = lambda t: self._fake(t, cp.x_hat(kept))  # noqa: E731
            # the backward on codes: dL/dx on the weight's codes where the format has it,
            # dL/dW on the kept activation codes
            grad_x_fn = grad_w_fn = None
            if on_codes and cp.grad_input_on_codes:
                grad_x_fn = lambda g: cp.grad_input(g, qw)  # noqa: E731
            if on_codes and kept is not None:
                grad_w_fn = cp.grad_weight
            # W_hat, for a float dL/dx: on the kernel the forward never reads it, so the
            # backward makes it, one layer at a time; the fake forward reads it, cached per
            # weight version
            w_hat = (None if grad_x_fn is not None
                     else (lambda: self._dequantize(qw, compute)) if on_kernel
                     else self.dequantized(compute))
            # under autocast x may arrive in bf16 from the op before; the scheme's kernel and
            # quantizers take fp32
            run = fn if compute == torch.float32 else (lambda t, f=fn: f(t.float()))
            y = _STELinear.apply(x2, self.weight, self.bias, run, x_hat_fn, w_hat, act, compute,
                                 (grad_x_fn, grad_w_fn))
        return y.reshape(*lead, self.out_features)

    def _fake_lowp(self, x: Tensor, x2: Tensor, compute: torch.dtype) -> Tensor:
        """The fake forward with grad in a 16-bit gradient pass (autocast to `compute`), as a
        full-precision learner's F.linear runs there: x_hat = act_qdq(x) in `compute`, kept
        for the backward, times the weight dequantized in `compute` once per weight version
        (not cast again per micro-batch), the result in `compute`; the backward's products
        take the same two operands. x [..., K], x2 its [M, K] view -> [M, N]. The layers of
        a fused group (q/k/v, gate/up) take the same x and quantize it alike (equal schemes:
        `link_fused_peers`), so the first computes x_hat and the others take it: one
        quantization and one kept copy per group."""
        x_hat = self._peers_x_hat(x, compute)
        if x_hat is None:
            x_hat = self.scheme.act_qdq_to(x2.detach(), compute)
        # weak references: the graph that saves x_hat keeps it alive, not this layer
        self._x_hat = (weakref.ref(x), x._version, weakref.ref(x_hat))
        w_hat = self.dequantized(compute)
        fn = lambda _: self._bias(F.linear(x_hat, w_hat))  # noqa: E731
        return _STELinear.apply(x2, self.weight, self.bias, fn, lambda t: t, w_hat, (x_hat,),
                                compute, (None, None))

    def __getstate__(self) -> dict:
        # copies and pickles (deepcopy, Ray) take no weak references
        return {**self.__dict__, "_x_hat": None}

    def _peers_x_hat(self, x: Tensor, compute: torch.dtype) -> Tensor | None:
        """The x_hat a fused peer made of this very x (same tensor, unchanged since) in
        `compute`, where it is still alive; else None."""
        for peer in self.fused_peers:
            if peer._x_hat is None:
                continue
            ref, version, hat = peer._x_hat
            x_hat = hat()
            if ref() is x and version == x._version and x_hat is not None \
                    and x_hat.dtype == compute:
                return x_hat
        return None

    def _bias(self, y: Tensor) -> Tensor:
        return y if self.bias is None else y + self.bias.float()

    def _fake(self, x: Tensor, x_hat: Tensor | None = None) -> Tensor:  # [M, K] -> [M, N]
        # in x's dtype; x_hat: act_qdq(x) where the caller has it
        x_hat = self.scheme.act_qdq(x) if x_hat is None else x_hat
        return self._bias(F.linear(x_hat, self.dequantized())).to(x.dtype)

    def kernel_path(self) -> str:
        if self.mode == "fake":
            return "F.linear on act_qdq(x) and the dequantized weight (mode fake)"
        return self.scheme.kernel_path(self.weight.device, self.qweight())

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, scheme={self.scheme.name}, mode={self.mode}")
