"""CUDA side of the reliability guards (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from qarl.train import checkpoint
from qarl.train.guards import is_out_of_memory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_rng_states_are_saved_and_restored(tmp_path):
    """With CUDA in use, a checkpoint holds each device's RNG state: restoring it replays the
    same CUDA random draws bit for bit."""
    torch.manual_seed(3)
    torch.randn(4, device="cuda")
    model = torch.nn.Linear(4, 4)
    folder = checkpoint.save(tmp_path, 1, model, [], {}, checkpoint.capture_rng(), "", keep=1)
    expected = torch.randn(16, device="cuda")
    _, rng = checkpoint.load(folder, model, [])
    assert len(rng.cuda) == torch.cuda.device_count()
    checkpoint.restore_rng(rng)
    assert torch.equal(torch.randn(16, device="cuda"), expected)


def test_a_real_cuda_out_of_memory_is_recognized():
    """The error torch raises for an impossible CUDA allocation is recognized as out of
    memory (the trainer then stops with the settings to lower)."""
    with pytest.raises(torch.OutOfMemoryError) as err:
        torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
    assert is_out_of_memory(err.value)
