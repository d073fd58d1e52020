"""train.compute_dtype: what 'auto' picks, and that a bf16-master run only passes as a dry run."""

from __future__ import annotations

import contextlib

import pytest
import torch

from qarl.config import load_config
from qarl.quant import kernels as K
from qarl.native import isa
from qarl.train.learner import precision


@pytest.mark.parametrize("flags, want", [
    ({"avx512_bf16", "amx_bf16", "amx_tile"}, torch.bfloat16), ({"avx512_bf16"}, torch.float32),
    ({"avx2"}, torch.float32)])
def test_auto_is_bf16_on_amx_cpus_and_cuda_fp32_on_other_cpus(monkeypatch, flags, want):
    """'auto' picks bf16 where bf16 GEMMs are much faster (AMX-BF16, CUDA), fp32 on other
    CPUs, with or without AVX512-BF16; the log line says which and why."""
    monkeypatch.setattr(isa, "cpu_flags", lambda: flags)
    assert precision.resolve_compute_dtype("auto", torch.device("cpu")) == want
    assert precision.resolve_compute_dtype("auto", torch.device("cuda")) == torch.bfloat16
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        assert precision.resolve_compute_dtype(name, torch.device("cpu")) == dtype
    line = precision.describe_compute(want, "auto")
    assert line.startswith(str(want).removeprefix("torch.")) and "'auto'" in line
    reason = {torch.bfloat16: "AMX-BF16", torch.float32: "no AMX" if "avx512_bf16" in flags
              else "without bf16 arithmetic"}[want]
    assert reason in line, line
    assert "bf16 on CUDA" in precision.describe_compute(torch.bfloat16, "auto",
                                                        torch.device("cuda"))


def test_bf16_masters_load_for_a_run_that_trains_nothing():
    config = load_config("tiny", {"model.master_dtype": "bfloat16", "train.lr": 0.0,
                                  "sft.steps": 0})
    assert config.model.master_dtype == "bfloat16"


@pytest.mark.parametrize("vendor, flags, env, want", [
    ("AuthenticAMD", {"avx2", "avx512f"}, "", "onednn"), ("AuthenticAMD", {"avx2"}, "", "mkl"),
    ("GenuineIntel", {"avx2", "avx512f"}, "", "mkl"), ("", set(), "", "mkl"),
    ("GenuineIntel", {"avx2"}, "onednn", "onednn"), ("AuthenticAMD", {"avx512f"}, "mkl", "mkl")])
def test_cpu_fp32_gemm_library_by_vendor_and_environment(monkeypatch, vendor, flags, env, want):
    """oneDNN on AMD CPUs with AVX-512 (MKL runs its AVX2 code there), MKL elsewhere, the
    AVX2-only AMD CPUs included; QARL_CPU_GEMM overrides; off the CPU neither (torch's own
    GEMMs)."""
    monkeypatch.setattr(K, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(K, "cpu_flags", lambda: flags)
    monkeypatch.setattr(K, "onednn_available", lambda device: device.type == "cpu")
    monkeypatch.setenv(K.CPU_GEMM_ENV, env)
    assert K.cpu_fp32_gemm(torch.device("cpu")) == want
    assert K.cpu_fp32_gemm(torch.device("meta")) is None
    config = load_config("tiny", {"train.compute_dtype": "float32"})
    fp32 = precision.Precision.of(config.train, config.quant)  # resolved once, held
    assert fp32.gemm == want
    assert isinstance(fp32.gradient_pass(), precision.LearnerLinears) == (want == "onednn")
    line = fp32.describe()
    assert ("GEMMs by oneDNN" in line) == (want == "onednn")
    monkeypatch.setenv(K.CPU_GEMM_ENV, "blas")
    with pytest.raises(ValueError, match=r"QARL_CPU_GEMM='blas'; valid: \['mkl', 'onednn'\]"):
        K.cpu_fp32_gemm(torch.device("cpu"))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_learner_linears_run_every_linear_by_onednn_with_the_same_gradients(monkeypatch):
    """Inside LearnerLinears each F.linear (an nn.Linear's forward, with or without bias, on
    [B, T, K] input) is _LearnerLinear, and forward and gradients equal the MKL ones to fp32
    rounding."""
    monkeypatch.setenv(K.CPU_GEMM_ENV, "onednn")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(),
                              torch.nn.Linear(96, 32, bias=False))
    x = torch.randn(3, 5, 64, requires_grad=True)

    def run(mode):
        net.zero_grad()
        x.grad = None
        with mode:
            y = net(x)
        y.square().sum().backward()
        return y, [x.grad.clone()] + [p.grad.clone() for p in net.parameters()]

    def linear_node(y):  # the node under the reshape back to [B, T, N]
        node = y.grad_fn
        return type(node.next_functions[0][0] if "View" in type(node).__name__ else node).__name__

    y_dnn, g_dnn = run(precision.LearnerLinears())
    assert linear_node(y_dnn) == "_LearnerLinearBackward"
    y_mkl, g_mkl = run(contextlib.nullcontext())
    assert linear_node(y_mkl) != "_LearnerLinearBackward"
    torch.testing.assert_close(y_dnn, y_mkl, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_dnn, g_mkl):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("flags, scheme, align, compute, want", [
    ({"avx512_vnni"}, "w8a8-int8", "kernel", torch.float32, "codes"),
    ({"amx_int8", "amx_tile"}, "w8a8-int8", "kernel", torch.float32, "codes"),
    ({"avx512_vnni"}, "w8a8-int8", "kernel", torch.bfloat16, "float"),  # a bf16 pass
    ({"avx512_vnni"}, "w8a8-int8", "fake", torch.float32, "float"),
    ({"avx2"}, "w8a8-int8", "kernel", torch.float32, "codes"),  # qarl.native's AVX2 int8
    ({"avx512_bf16"}, "w4a16-int4", "kernel", torch.float32, "codes"),  # bf16 activations
    ({"avx512_vnni"}, "w4a16-int4", "kernel", torch.float32, "float"),  # no bf16 arithmetic
    ({"avx512_bf16"}, "w4a8-int", "kernel", torch.float32, "float"),  # no backward on codes
    ({"avx512_bf16"}, "w8a8-fp8", "kernel", torch.float32, "float"),
])
def test_auto_backward_on_codes_where_the_int8_gemm_is_the_fast_one(
        monkeypatch, flags, scheme, align, compute, want):
    """train.quant_backward = 'auto' multiplies on the codes only for an fp32 gradient pass of
    a kernel-aligned learner where those GEMMs are the fast ones: w8a8-int8 on a CPU whose
    int8 GEMM is torch._int_mm on VNNI or qarl.native's (AMX, VNNI, AVX2), W4A16 on a CPU
    with bf16 arithmetic; the explicit values are taken as they are; the log line says
    which."""
    from qarl.quant import kernels as K

    if scheme == "w8a8-int8" and "avx2" in flags and not K.native_ok(torch.device("cpu")):
        pytest.skip("qarl.native is not built here: its AVX2 int8 GEMM is what 'auto' takes")
    monkeypatch.setattr(isa, "cpu_flags", lambda: flags)
    cpu = torch.device("cpu")
    assert precision.resolve_quant_backward("auto", scheme, align, cpu, compute) == want
    for value in ("float", "codes"):
        assert precision.resolve_quant_backward(value, scheme, align, cpu, compute) == value
    line = precision.describe_quant_backward(want, "auto", scheme)
    assert ("on codes" in line) == (want == "codes") and "'auto'" in line
    assert ("int8 GEMM" in line) == (want == "codes" and scheme == "w8a8-int8")
    assert "slowly" not in line  # auto never picks a slow backward


@pytest.mark.parametrize("flags, native, slow", [({"avx2"}, False, True), ({"avx2"}, True, False),
                                                 ({"avx512_vnni"}, False, False),
                                                 ({"amx_int8"}, True, False)])
def test_an_explicit_backward_on_codes_says_where_it_runs_slowly(monkeypatch, flags, native, slow):
    """train.quant_backward = 'codes' where the int8 GEMM is neither torch._int_mm on VNNI
    nor qarl.native's (an AVX2-only CPU without the native kernels: fp32 GEMMs on the codes)
    is taken, and the run's first lines say it runs slowly there."""
    from qarl.quant import kernels as K

    if native and not K.native_ok(torch.device("cpu")):
        pytest.skip("qarl.native is not built here")
    monkeypatch.setattr(isa, "cpu_flags", lambda: flags)
    if not native:
        monkeypatch.setattr(K, "native_ok", lambda device: False)
    line = precision.describe_quant_backward("codes", "codes", "w8a8-int8")
    assert "on codes" in line and ("slowly" in line) == slow


def test_a_learner_takes_its_precisions_backward_on_every_quantized_layer():
    """`learner_model` applies the run's Precision (train.quant_backward resolved) to every
    quantized layer; `quantize_learner` alone (a learner that does not train: qarl parity)
    leaves the float backward; the Precision of a naive or identity learner has none."""
    from qarl.model import load_model
    from qarl.quant import QuantLinear
    from qarl.train.policy import learner_model, quantize_learner

    config = load_config("tiny", {"train.quant_backward": "codes"})
    model, _ = learner_model(load_model("tiny"), config, precision.Precision.of(config.train,
                                                                               config.quant))
    backwards = {m.backward for m in model.modules() if isinstance(m, QuantLinear)}
    assert backwards == {"codes"}
    for quant in ({"quant.align": "naive"}, {"quant.scheme": "none"}):
        other = load_config("tiny", quant)
        assert precision.Precision.of(other.train, other.quant).quant_backward is None
    plain = quantize_learner(load_model("tiny"), config.quant)  # not a training learner
    assert {m.backward for m in plain.modules() if isinstance(m, QuantLinear)} == {"float"}
