"""vLLM's CPU int8 GEMM (the oneDNN path of its W8A8 compressed-tensors layers) against exact
integer arithmetic: exact on CPUs with VNNI, int16-saturating pair sums without (the cause of
the int8 gap between VLLMEngine and qarl's engines; qarl/rollout/vllm_engine.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from qarl.quant import numerics as nm  # noqa: E402
from qarl.rollout.vllm_support import int8_gemm_saturates  # noqa: E402


def saturating_int8_dot(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """sum_k xq[m, k] wq[n, k] as oneDNN computes it without VNNI: u = xq + 128 (uint8), each
    adjacent pair u_k w_k + u_k+1 w_k+1 clamped to int16, the int32 sum of pairs minus
    128 * sum_k w_k. xq [M, K], wq [N, K] int8 -> [M, N] int64."""
    u = xq.to(torch.int64) + 128  # [M, K]
    w = wq.to(torch.int64)  # [N, K]
    p = u[:, None, :] * w[None]  # [M, N, K]
    pairs = (p[..., 0::2] + p[..., 1::2]).clamp(-32768, 32767)  # [M, N, K/2]
    return pairs.sum(-1) - 128 * w.sum(-1)[None]


def test_vllm_cpu_int8_gemm_exact_or_saturating():
    """vLLM's dynamic per-token W8A8 GEMM on qarl's codes: with VNNI (or off x86) it equals
    (xq wq) s_x s_w to fp32 rounding; on an x86 CPU without VNNI it equals the saturating
    emulation to fp32 rounding and is off the exact products by more than 1e-2 relative on rows
    of positive activations (u near 255), while a row of negative activations (u near 1)
    stays exact."""
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's oneDNN int8 GEMM is the CPU build's")
    g = torch.Generator().manual_seed(0)
    wq, ws = nm.int8_rows(torch.randn(64, 256, generator=g))  # [N, K] int8, [N]
    x = torch.randn(8, 256, generator=g).abs() + 0.5  # [M, K] positive: u = q + 128 near 255
    x[0] = -x[0]
    xq, xs = nm.int8_rows(x)
    handler = ops.create_onednn_scaled_mm(wq.t(), ws.reshape(-1, 1), torch.float32, True, False, 32)
    q, s, zp = ops.onednn_scaled_int8_quant(x, None, None, True)
    assert torch.equal(q, xq) and torch.equal(s.reshape(-1), xs)
    out = torch.empty(8, 64)
    ops.onednn_scaled_mm(handler, q, out, s, zp, None, None)

    def rel(acc):  # [M] max relative error per row
        y = acc.double() * xs.double()[:, None] * ws.double()[None]
        return ((out.double() - y).abs().amax(-1) / y.abs().amax(-1))

    exact = rel(xq.to(torch.int64) @ wq.to(torch.int64).T)
    if not int8_gemm_saturates():
        assert float(exact.max()) < 1e-6, exact
        return
    assert float(rel(saturating_int8_dot(xq, wq)).max()) < 1e-6
    assert float(exact[0]) < 1e-6 and float(exact[1:].min()) > 1e-2, exact
