"""benchmarks/roofline.py: the update's work counted from a batch as the gradient forward runs
it (each distinct prompt once per micro-batch, the packed response positions, the lm_head at
response positions), and a whole run on the tiny recipe giving every phase a floor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import roofline  # noqa: E402

from qarl.config import load_config  # noqa: E402
from qarl.types import RolloutBatch  # noqa: E402


def test_update_work_counts_shared_prompts_once_and_packed_responses():
    """8 rows, two prompts of 4 rows (P = 5), micro-batches of 4: each micro-batch runs one
    prompt (5 positions) and its rows' response positions that predict another token (length
    - 1 each); the lm_head runs at every response token; two epochs double everything."""
    P, L = 5, 4
    prompt_ids = torch.tensor([[1, 2, 3, 4, 5]] * 4 + [[6, 7, 8, 9, 10]] * 4)
    lengths = torch.tensor([4, 3, 1, 2, 4, 4, 2, 1])
    mask = torch.arange(L)[None, :] < lengths[:, None]
    batch = RolloutBatch(prompt_ids, torch.ones(8, P, dtype=torch.bool),
                         torch.ones(8, L, dtype=torch.long), mask, torch.zeros(8, L),
                         finish_reasons=["stop"] * 8)
    config = load_config("tiny", {"train.micro_batch_size": 4, "algo.epochs": 2})
    work = roofline.update_work(batch, config, config.train, config.algo)
    packed = int((lengths - 1).clamp(min=0).sum())
    assert work["micro_batches"] == 4
    assert work["block_rows"] == 2 * (2 * P + packed)
    assert work["head_rows"] == 2 * int(lengths.sum())
    assert work["head_recompute_rows"] == 0  # one logits chunk per micro-batch: none


@pytest.mark.slow
def test_a_tiny_run_gives_every_phase_a_floor():
    result = roofline.measure("tiny", {"train.steps": 3}, 3, True)
    for phase in roofline.PHASES:
        figures = result["phases"][phase]
        assert figures["measured"] > 0, phase
        if phase != "old_logp" or figures["work"] != "no rows replayed":
            assert figures["floor"] > 0 and figures["x_floor"] > 0, phase
    assert result["update_work"]["block_rows"] > result["update_work"]["head_rows"] > 0
    parts = result["update_parts"]
    assert parts["optimizer steps"]["measured"] > 0 and parts["optimizer steps"]["floor"] > 0
    assert parts["gradient pass"]["measured"] + parts["optimizer steps"]["measured"] == \
        pytest.approx(result["phases"]["update"]["measured"], abs=2e-3)


def _named(**shapes) -> torch.nn.Module:
    """A module whose parameters have the given dotted names and shapes."""
    module = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split("__")
        at = module
        for part in path:
            if not hasattr(at, part):
                at.add_module(part, torch.nn.Module())
            at = getattr(at, part)
        at.register_parameter(leaf, torch.nn.Parameter(torch.zeros(shape)))
    return module


@pytest.mark.parametrize("optimizer, clip, epochs, want_per_matrix, want_per_rest", [
    ("adamw", 1.0, 1, 32, 32),  # read w, g, m, v; write w, m, v; the clip reads g: 8 x 4 B
    ("adamw", 0.0, 1, 28, 28),
    ("adamw", 1.0, 2, 64, 64),  # one optimizer step per epoch
    ("muon", 1.0, 1, 24, 32),  # Muon's one momentum on the hidden matrices, AdamW elsewhere
])
def test_optimizer_bytes_count_each_trainable_parameters_reads_and_writes(
        optimizer, clip, epochs, want_per_matrix, want_per_rest):
    model = _named(layers__0__proj__weight=(3, 4), norm__weight=(4,), head__weight=(5, 4))
    frozen = _named(layers__0__proj__weight=(3, 4))
    frozen.requires_grad_(False)
    config = load_config("tiny", {"train.optimizer": optimizer, "train.grad_clip": clip,
                                  "algo.epochs": epochs})
    assert roofline.optimizer_bytes(model, config) == 12 * want_per_matrix + 24 * want_per_rest
    assert roofline.optimizer_bytes(frozen, config) == 0  # frozen weights move nothing


@pytest.mark.parametrize("overrides, backward, want", [
    ({}, "codes", ("forward", "grad_x")),
    ({}, "float", ("forward",)),
    ({"quant.align": "fake"}, "codes", ()),
    ({"quant.scheme": "none"}, None, ()),
    ({"quant.scheme": "w4a16-int4"}, "codes", ()),  # its kernel is no gradient forward; dL/dx float
])
def test_the_update_floor_counts_kernel_products_at_the_kernels_speed(overrides, backward, want):
    """The update's floor times a quantized linear's forward on the format's kernel where the
    fp32 gradient pass runs it (kernel alignment), and dL/dx there too where the backward
    multiplies on the weight's codes; everything else at the learner's GEMM."""
    from dataclasses import replace

    from qarl.train.learner.precision import Precision

    config = load_config("default", {"train.compute_dtype": "float32", **overrides})
    precision = replace(Precision.of(config.train, config.quant), quant_backward=backward)
    assert roofline.kernel_products(config, precision) == want
