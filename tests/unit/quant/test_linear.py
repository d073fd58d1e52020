"""QuantLinear: modes, straight-through gradients, weight-version caching, learner = engine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qarl.quant import SCHEMES, QuantLinear, QWeight


def _layer(name: str, mode: str, seed: int = 0, k: int = 256, n: int = 96, bias: bool = True):
    torch.manual_seed(seed)
    return QuantLinear.from_linear(nn.Linear(k, n, bias=bias), name, mode)


@pytest.mark.parametrize("mode", ["fake", "kernel"])
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_ste_gradient_equals_dequantized_layer_gradient(name, mode):
    """The gradient w.r.t. the master weight (and x, bias) equals the gradient of
    F.linear(act_qdq(x), W_hat) w.r.t. W_hat, with the activation quantizer passed straight
    through; identical bits, since both are the same fp32 matmuls."""
    layer = _layer(name, mode)
    x = torch.randn(3, 5, 256, requires_grad=True)
    g = torch.randn(3, 5, 96)
    (layer(x) * g).sum().backward()

    scheme = layer.scheme
    w_hat = scheme.dequantize(scheme.quantize(layer.weight.detach())).requires_grad_()
    b = layer.bias.detach().clone().requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    x_flat = x_ref.reshape(-1, 256)
    x_hat = x_flat + (scheme.act_qdq(x_flat) - x_flat).detach()  # straight-through act quant
    y_ref = torch.nn.functional.linear(x_hat, w_hat) + b
    (y_ref * g.reshape(-1, 96)).sum().backward()
    assert torch.equal(layer.weight.grad, w_hat.grad)
    assert torch.equal(layer.bias.grad, b.grad)
    assert torch.allclose(x.grad, x_ref.grad, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_learner_kernel_equals_engine_bit_for_bit(name):
    """A kernel-mode learner layer and an engine layer holding the exported QWeight (through a
    tensors round trip, on a different master weight) give identical bits: the learner runs all
    rows at once, the engine one row at a time, over several seeds and shapes."""
    for seed, (k, n) in enumerate([(256, 96), (576, 192), (128, 48)]):
        learner = _layer(name, "kernel", seed, k, n)
        engine = _layer(name, "kernel", seed + 50, k, n)
        engine.bias.data.copy_(learner.bias.data)
        engine.install(QWeight.from_tensors(learner.qweight().tensors()))
        x = torch.randn(24, k, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            full = learner(x)
            rows = torch.cat([engine(x[i:i + 1]) for i in range(24)])
        assert torch.equal(full, rows), (name, k, n)
        training = learner(x.requires_grad_())
        if learner.scheme.kernel_for_gradients(x.device):  # int8: the training forward too
            assert torch.equal(training, full)
        else:  # the fake forward on a BLAS GEMM: the kernel's function, up to rounding
            fake = _layer(name, "fake", seed, k, n)
            fake.bias.data.copy_(learner.bias.data)
            assert torch.equal(training, fake(x))
            assert torch.allclose(training, full, rtol=1e-4, atol=1e-4 * full.abs().max())


def test_decoding_never_requantizes_and_a_step_requantizes_once():
    """Forward passes reuse the cached QWeight; an optimizer step triggers exactly one
    re-quantization at the next forward, however many forwards follow."""
    layer = _layer("w8a8-int8", "kernel")
    x = torch.randn(4, 256)
    with torch.no_grad():
        for _ in range(5):
            layer(x)
    assert layer.quantize_count == 1
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(x).sum().backward()
    opt.step()
    for _ in range(3):
        layer(x)
    assert layer.quantize_count == 2


def test_installed_qweight_is_used_until_master_changes():
    """An installed QWeight is used as-is (no quantization); editing the master re-quantizes."""
    learner, engine = _layer("w4a16-int4", "kernel", 0), _layer("w4a16-int4", "kernel", 1)
    engine.install(learner.qweight())
    with torch.no_grad():
        engine(torch.randn(2, 256))
    assert engine.quantize_count == 0 and engine.qweight() is not learner.qweight()
    with torch.no_grad():
        engine.weight.mul_(2)
        engine(torch.randn(2, 256))
    assert engine.quantize_count == 1


def test_install_rejects_mismatched_scheme_or_shape():
    """Installing a QWeight of another scheme, group size or shape raises."""
    layer = _layer("w4a16-int4", "kernel")
    other = _layer("w4a16-nvfp4", "kernel").qweight()
    with pytest.raises(ValueError, match="w4a16-nvfp4"):
        layer.install(other)
    with pytest.raises(ValueError, match="shape"):
        layer.install(_layer("w4a16-int4", "kernel", k=128).qweight())


@pytest.mark.parametrize("mode", ["none", "real"])
def test_unknown_mode_raises(mode):
    """A mode other than fake / kernel raises and names the valid ones (full precision is a
    plain nn.Linear, not a QuantLinear mode)."""
    with pytest.raises(ValueError, match=r"\['fake', 'kernel'\]"):
        QuantLinear.from_linear(nn.Linear(64, 32), "w8a8-int8", mode)


@pytest.mark.parametrize("name", ["w8a8-int8", "w4a16-int4", "w8a8-fp8"])
def test_bfloat16_model(name):
    """A bf16 layer runs in kernel mode, returns bf16, and is batch-invariant too."""
    layer = _layer(name, "kernel").to(torch.bfloat16)
    x = torch.randn(9, 256).bfloat16()
    with torch.no_grad():
        y = layer(x)
        assert y.dtype == torch.bfloat16
        assert torch.equal(layer(x[4:5])[0], y[4])


def test_training_after_inference_mode_decode():
    """A layer first used under torch.inference_mode (the engine decoding with a shared
    model) still trains afterwards: cached QWeights are ordinary tensors."""
    layer = _layer("w8a8-fp8", "kernel")
    with torch.inference_mode():
        layer(torch.randn(2, 256))
    layer(torch.randn(2, 256)).sum().backward()
    assert layer.weight.grad is not None and layer.quantize_count == 1


@pytest.mark.parametrize("name", ["w8a8-int8", "w4a16-int4"])
def test_ste_backward_under_bf16_autocast_multiplies_in_bf16(name):
    """Under autocast (train.compute_dtype = 'bfloat16') every format's gradient forward is a
    bf16 GEMM of x_hat and the dequantized weight rounded to bf16 (int8's int32 kernel runs in
    fp32 passes only: `Scheme.kernel_for_gradients`), within bf16 rounding of the fp32
    forward; the backward's two GEMMs are bf16 GEMMs of the same operands: equal to them
    exactly, within bf16 rounding of the fp32 gradient, and the master weight's gradient
    stays fp32."""
    layer = _layer(name, "kernel", bias=False)
    x = torch.randn(40, 256)
    g = torch.randn(40, 96)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    y32 = layer(xs[0])
    (y32 * g).sum().backward()
    grad32, layer.weight.grad = layer.weight.grad, None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y16 = layer(xs[1])
    (y16 * g).sum().backward()
    w_hat = layer.dequantized().bfloat16()
    x_hat = layer.scheme.act_qdq(x).bfloat16()
    assert not layer.scheme.kernel_for_gradients(x.device, torch.bfloat16)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, x_hat @ w_hat.t())
    assert (y16.float() - y32).abs().max() <= 3e-2 * y32.abs().max()
    assert layer.weight.grad.dtype == torch.float32
    assert torch.equal(layer.weight.grad, (g.bfloat16().t() @ x_hat).float())
    assert torch.equal(xs[1].grad, (g.bfloat16() @ w_hat).float())
    # bf16 keeps 8 mantissa bits: each product's inputs within 2^-8 relative, sums of 40/96
    # terms of mixed sign -> a few 1e-2 of the gradient's scale
    scale = grad32.abs().max()
    assert (layer.weight.grad - grad32).abs().max() <= 3e-2 * scale
    assert (xs[1].grad - xs[0].grad).abs().max() <= 3e-2 * xs[0].grad.abs().max()


@pytest.mark.parametrize("gemm", ["auto", "int_mm", "native"])
def test_int8_gradient_pass_keeps_no_dequantized_weight(gemm):
    """W8A8 in kernel mode with grad: where the int8 GEMM runs on codes computed outside it
    (torch._int_mm at 16+ rows: a CPU with VNNI or AMX-INT8) the layer keeps the int8 codes
    and scales of x for the backward, not x (4x smaller); where qarl.native's kernel
    quantizes inside (an AVX2-only CPU) it keeps x. On every path it keeps no dequantized
    weight (made in the backward, one layer at a time, instead of held for every layer
    through the step), and the gradients are those of x_hat = act_qdq(x) and W_hat (the same
    straight-through gradient as the re-quantizing path, bit for bit)."""
    from qarl.quant import kernels as K
    from qarl.quant.schemes_8bit import Int8Scheme

    if gemm == "native" and not K.native_ok(torch.device("cpu")):
        pytest.skip("qarl.native is not built here")
    torch.manual_seed(0)
    layer = QuantLinear.from_linear(nn.Linear(256, 96), Int8Scheme(gemm=gemm), "kernel")
    x = torch.randn(40, 256, requires_grad=True)
    g = torch.randn(40, 96)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    if layer.codes_pass.forward_codes(x.detach()) is not None:
        assert (torch.int8, (40, 256)) in saved and (torch.float32, (40, 256)) not in saved
    else:
        assert layer.scheme.method(x.device) == "native"
        assert saved.count((torch.float32, (40, 256))) == 1 and torch.int8 not in dict(saved)
    assert (torch.float32, (96, 256)) not in saved and not layer._dequantized
    (y * g).sum().backward()
    assert not layer._dequantized
    x_hat = layer.scheme.act_qdq(x.detach())
    assert torch.equal(layer.weight.grad, K.learner_mm(g.t(), x_hat))
    assert torch.equal(x.grad, K.learner_mm(g, layer.dequantized()))
    # the forward's value is the kernel's own (the engine's bits)
    assert torch.equal(y.detach(), layer.scheme.linear(x.detach(), layer.qweight(), layer.bias))


def _codes_reference(layer: QuantLinear, x: torch.Tensor, g: torch.Tensor):
    """dL/dx and dL/dW of the backward on codes, computed from their definition with exact
    integer products: g' = g s_w quantized per row, times the weight codes; g s_x times the
    activation codes, in the dtype `Int8Codes.grad_weight` picks."""
    from qarl.quant import numerics as nm
    from qarl.quant.codes import bf16_fast

    qw = layer.qweight()
    gq, gs = nm.int8_rows(g * qw.scales)
    acc = (gq.long() @ qw.codes.long()).to(torch.int32)  # exact
    grad_x = acc.float() * gs[:, None]
    xq, xs = nm.int8_rows(x)
    dtype = torch.bfloat16 if bf16_fast(x.device) else torch.float32
    grad_w = ((g * xs[:, None]).to(dtype).t() @ xq.to(dtype)).float()
    return grad_x, grad_w


@pytest.mark.parametrize("name", ["w4a16-int4", "w4a16-nvfp4"])
@pytest.mark.parametrize("mode", ["fake", "kernel"])
def test_backward_on_codes_of_bf16_activations(name, mode):
    """A W4A16 layer's backward on codes keeps x_hat = bf16(x) in bf16 (not x in fp32) and
    multiplies dL/dW on it, in bf16 where the CPU has bf16 arithmetic (the exact operand:
    g's rounding only, bound 0.5% of the norm), fp32 else (then the float backward's bits);
    the forward and dL/dx are the float backward's, bit for bit."""
    from qarl.quant.codes import bf16_fast

    layers = [_layer(name, mode) for _ in range(2)]
    layers[1].backward = "codes"
    x = torch.randn(40, 256)
    g = torch.randn(40, 96)
    xs = [x.clone().requires_grad_() for _ in layers]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append((t.dtype, tuple(t.shape))) or t, lambda t: t):
        ys = [layers[0](xs[0])]
        saved.clear()
        ys.append(layers[1](xs[1]))
    assert (torch.bfloat16, (40, 256)) in saved and (torch.float32, (40, 256)) not in saved
    assert torch.equal(ys[0], ys[1])
    for y in ys:
        (y * g).sum().backward()
    assert torch.equal(xs[1].grad, xs[0].grad)
    assert torch.equal(layers[1].bias.grad, layers[0].bias.grad)
    if bf16_fast(x.device):
        ref = (g.bfloat16().t() @ x.bfloat16()).float()
        assert torch.equal(layers[1].weight.grad, ref)
        rel = (ref - layers[0].weight.grad).norm() / layers[0].weight.grad.norm()
        assert 0 < rel < 0.005
    else:
        assert torch.equal(layers[1].weight.grad, layers[0].weight.grad)


@pytest.mark.parametrize("gemm", ["auto", "int_mm"])
def test_backward_on_codes_is_switchback_with_the_forward_unchanged(gemm):
    """QuantLinear.backward = "codes" (train.quant_backward): the forward is the same bits;
    dL/dx is the int8 GEMM of g s_w, quantized per row, with the weight codes, equal to the
    exact integer product scaled by the row scales; dL/dW, where the forward ran on
    activation codes (torch._int_mm: VNNI / AMX, or gemm = int_mm), is g s_x times those
    codes in bf16 where the CPU has bf16 arithmetic (codes are exact in bf16), fp32 else,
    and the float backward's bits where the kernel quantized inside (qarl.native). Against
    the float backward: dL/dx within g's int8 rounding, 0.5 / 127 of a row's largest
    |g' s_w| per element, which for Gaussian rows of 96 is ~0.8% of the norm (bound 2%);
    dL/dW within bf16 rounding of g s_x (2^-9 relative per element: bound 0.5%). No
    dequantized weight is made or kept."""
    from qarl.quant.schemes_8bit import Int8Scheme

    torch.manual_seed(0)
    layers = [QuantLinear.from_linear(nn.Linear(256, 96), Int8Scheme(gemm=gemm), "kernel")
              for _ in range(2)]
    layers[1].load_state_dict(layers[0].state_dict())
    layers[1].backward = "codes"
    x = torch.randn(40, 256)
    g = torch.randn(40, 96)
    xs = [x.clone().requires_grad_() for _ in layers]
    ys = [layer(xi) for layer, xi in zip(layers, xs)]
    assert torch.equal(ys[0], ys[1])
    for y in ys:
        (y * g).sum().backward()
    assert not layers[1]._dequantized
    ref_x, ref_w = _codes_reference(layers[1], x, g)
    assert torch.equal(xs[1].grad, ref_x)
    assert torch.equal(layers[1].bias.grad, layers[0].bias.grad)
    if layers[1].codes_pass.forward_codes(x) is not None:
        assert torch.equal(layers[1].weight.grad, ref_w)
    else:  # the native kernel quantized inside: no codes kept, x_hat as the float backward
        assert torch.equal(layers[1].weight.grad, layers[0].weight.grad)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert 1e-4 < rel(xs[1].grad, xs[0].grad) < 0.02
    assert rel(layers[1].weight.grad, layers[0].weight.grad) < 0.005


def test_grad_input_codes_native_and_torch_paths_agree(monkeypatch):
    """The one-pass native quantizer of g s_w and scaling give the torch ops' bits."""
    from qarl.quant import kernels as K
    from qarl.quant.schemes_8bit import Int8Scheme

    if not K.native_ok(torch.device("cpu")):
        pytest.skip("qarl.native is not built here")
    scheme = Int8Scheme()
    torch.manual_seed(1)
    qw = scheme.quantize(torch.randn(96, 256) * 0.05)
    g = torch.randn(33, 96)
    native = scheme.codes_pass().grad_input(g, qw)
    monkeypatch.setattr(K, "native_ok", lambda device: False)
    assert torch.equal(native, scheme.codes_pass().grad_input(g, qw))


def test_grad_input_codes_native_gemm_gives_the_int_mm_bits():
    """dL/dx on the weight's codes through qarl.native's int8 GEMM (gemm = native: AVX2, VNNI
    or AMX, on the codes transposed into its panels once per weight version) equals the
    torch._int_mm product's bits, for shapes whose rows and columns fill no whole panel."""
    from qarl.quant import kernels as K
    from qarl.quant.schemes_8bit import Int8Scheme

    if not K.native_ok(torch.device("cpu")):
        pytest.skip("qarl.native is not built here")
    torch.manual_seed(2)
    for n, k in ((96, 256), (50, 577), (7, 20)):
        qw = Int8Scheme().quantize(torch.randn(n, k) * 0.05)
        g = torch.randn(21, n)
        native = Int8Scheme(gemm="native").codes_pass().grad_input(g, qw)
        assert ("native-s8-t", torch.device("cpu")) in qw.prepared
        assert torch.equal(native, Int8Scheme(gemm="int_mm").codes_pass().grad_input(g, qw))
