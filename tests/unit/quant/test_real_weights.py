"""Quantization error on real SmolLM2-135M weights (slow: loads and quantizes 210 matrices)."""

from __future__ import annotations

import pytest
import torch

from qarl.quant import SCHEMES, make_scheme

# Worst-layer SQNR floors in dB over the 210 block projections (measured values, README, minus
# ~1 dB). The zoo model is dequantized from a Q4_1 GGUF (blocks of 32, min/scale), so int4
# with group 32 asymmetric lands almost on its grid.
REAL_SQNR_FLOOR = {
    "none": 200.0, "w8a8-int8": 37.5, "w8a8-fp8": 30.5, "w8a8-fp8-block": 30.5,
    "w4a16-int4": 16.5, "w4a16-nvfp4": 19.5, "w4a8-int": 16.5,
}


@pytest.fixture(scope="module")
def smollm2_weights():
    from qarl.model import load_model

    try:
        model = load_model("smollm2-135m")
    except Exception as error:  # the pip package holding the GGUF is not installed
        pytest.skip(f"smollm2-135m unavailable: {error}")
    return [p.detach() for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n]


def _worst_sqnr(scheme, weights) -> float:
    # SQNR = 10 log10( sum w^2 / sum (w - w_hat)^2 ), worst over layers
    worst = float("inf")
    for w in weights:
        err = (w - scheme.dequantize(scheme.quantize(w))).pow(2).sum().clamp_min(1e-30)
        worst = min(worst, float(10 * torch.log10(w.pow(2).sum() / err)))
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_real_weight_sqnr_floor(name, smollm2_weights):
    """Every block projection of smollm2-135m keeps its format's SQNR floor."""
    assert len(smollm2_weights) == 210
    assert _worst_sqnr(SCHEMES[name], smollm2_weights) > REAL_SQNR_FLOOR[name]


@pytest.mark.slow
def test_int4_group32_asymmetric_fits_the_q4_1_source(smollm2_weights):
    """Weights that came from Q4_1 (32-blocks with a min) are near-lossless in int4 g32 asym."""
    scheme = make_scheme("w4a16-int4", group_size=32, symmetric=False)
    assert _worst_sqnr(scheme, smollm2_weights) > 45.0
