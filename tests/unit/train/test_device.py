"""The learner on any torch device, checked on the CPU (docs/training.md, "Devices").

The `meta` device has shapes and no data, and an op mixing a meta tensor with a CPU tensor of
one or more dimensions is an error: a learner's forward and backward, and every loss, that
run on meta create no tensor without the configured device. (Code whose shapes depend on data,
the engine's sampling or masked selections, cannot run on meta; the CUDA check in
benchmarks/gpu_check.sh runs it.) Also here: `train.device` values refused at load, and a
checkpoint written on one device that resumes through the device path with equal weights.
"""

from __future__ import annotations

import pytest
import torch

from qarl.algo import LOSSES, global_counts
from qarl.config import ConfigError, load_config
from qarl.model.sources import load_model, load_skeleton
from qarl.quant import quantize_model
from qarl.train import checkpoint
from qarl.train.learner.optim import build_optimizer
from qarl.types import RolloutBatch

META = torch.device("meta")


@pytest.mark.parametrize("align, scheme", [("naive", None), ("fake", "w8a8-int8"),
                                           ("fake", "w4a16-int4"), ("fake", "w8a8-fp8")])
def test_learner_forward_and_backward_run_on_meta(align, scheme):
    """A skeleton learner (every parameter on meta), plain (`naive`: the learner of naive
    alignment) or with `fake`-mode QuantLinears, runs its forward to logits and its backward
    to every parameter's gradient, all on meta."""
    model = load_skeleton("tiny")
    assert all(p.is_meta for p in model.parameters())
    if scheme is not None:
        quantize_model(model, scheme, mode=align)
    ids = torch.zeros(3, 7, dtype=torch.long, device=META)
    logits = model.lm_head(model(ids))
    assert logits.is_meta and tuple(logits.shape) == (3, 7, model.config.vocab_size)
    logits.float().logsumexp(-1).sum().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and g.is_meta for g in grads)


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_runs_on_meta(name):
    """Each loss, with the whole-batch counts the update passes it, computes its value and
    its gradient on meta: no CPU tensor inside."""
    N, L = 4, 6
    logp = torch.zeros(N, L, device=META, requires_grad=True)
    old, mu = torch.zeros(N, L, device=META), torch.zeros(N, L, device=META)
    advantages, mask = torch.zeros(N, device=META), torch.ones(N, L, dtype=torch.bool, device=META)
    counts = global_counts(name, old, mu, mask)
    loss, metrics = LOSSES[name](logp, old, mu, advantages, mask,
                                 is_weights=torch.ones(N, L, device=META), **counts)
    assert loss.is_meta and all(v.is_meta for v in metrics.values() if torch.is_tensor(v))
    loss.backward()
    assert logp.grad is not None and logp.grad.is_meta


def test_a_rollout_batch_moves_to_the_learner_device():
    """RolloutBatch.to moves every tensor (itself where they are there already)."""
    batch = RolloutBatch(prompt_ids=torch.zeros(2, 3, dtype=torch.long),
                         prompt_mask=torch.ones(2, 3, dtype=torch.bool),
                         response_ids=torch.zeros(2, 4, dtype=torch.long),
                         response_mask=torch.ones(2, 4, dtype=torch.bool),
                         rollout_logp=torch.zeros(2, 4), finish_reasons=["stop", "length"])
    assert batch.to("cpu") is batch
    moved = batch.to(META)
    assert all(t.is_meta for t in (moved.prompt_ids, moved.prompt_mask, moved.response_ids,
                                   moved.response_mask, moved.rollout_logp))
    assert moved.finish_reasons == batch.finish_reasons and moved.routed_experts is None


@pytest.mark.parametrize("device, fragment", [
    ("gpu", "'gpu' is not a device qarl trains on; use 'cpu', 'cuda' or 'cuda:N'"),
    ("cuda:x", "'cuda:x' is not a device qarl trains on"),
    ("cuda:99", "'cuda:99', but this machine has"),
])
def test_train_device_refused_at_load(device, fragment):
    """A device that does not exist is a problem of the recipe, before any work starts; on a
    CPU build of torch every CUDA device is refused naming the build."""
    if device == "cuda:99" and not torch.cuda.is_available():
        fragment = "'cuda:99', but this torch is a CPU build"
    with pytest.raises(ConfigError, match="train.device") as err:
        load_config("tiny", {"train.device": device})
    assert fragment in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-build message")
def test_cuda_on_a_cpu_machine_names_the_fix():
    with pytest.raises(ConfigError) as err:
        load_config("tiny", {"train.device": "cuda"})
    assert "'cuda', but this torch is a CPU build" in str(err.value)
    assert "use 'cpu'" in str(err.value)


def test_cuda_with_learner_ranks_is_refused(monkeypatch):
    """Learner ranks run on the CPU: with a (pretend) GPU, train.device = 'cuda' and two
    ranks is refused, naming both settings."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError) as err:
        load_config("tiny", {"train.device": "cuda", "dist.learner_ranks": 2})
    assert "dist.learner_ranks = 2: learner ranks run on the CPU" in str(err.value)
    assert load_config("tiny", {"train.device": "cuda:0"}).train.device == "cuda:0"


def test_checkpoint_resumes_through_the_device_path(tmp_path):
    """Checkpoints hold CPU tensors (safetensors) and loading copies them into the model
    wherever its parameters live: a model and AdamW state saved, then loaded into a fresh
    model moved `.to(device)` (the path build_policy takes for train.device), give equal
    weights and optimizer state on that device."""
    device = torch.device("cpu")
    model = load_model("tiny").to(device)
    opts = build_optimizer(model, "adamw", 1e-3, 0.0, (0.9, 0.999))
    model(torch.ones(1, 4, dtype=torch.long)).sum().backward()
    for opt in opts:
        opt.step()
    folder = checkpoint.save(tmp_path, 1, model, opts, {}, checkpoint.capture_rng(), "",
                             keep=1)
    fresh = load_model("tiny").to(device)
    fresh_opts = build_optimizer(fresh, "adamw", 1e-3, 0.0, (0.9, 0.999))
    checkpoint.load(folder, fresh, fresh_opts)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert b.device == device and torch.equal(a, b), name
    for opt, other in zip(opts, fresh_opts):
        for p, q in zip(opt.param_groups[0]["params"], other.param_groups[0]["params"]):
            for key, value in opt.state[p].items():
                assert torch.equal(value, other.state[q][key]), key
                assert other.state[q][key].device == device or key == "step"
