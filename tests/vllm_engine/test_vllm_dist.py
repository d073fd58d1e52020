"""[dist] rollout workers with rollout.engine = "vllm": each Ray actor runs its own VLLMEngine
and the joined batch is the one engine's batch (`make test-vllm`; skipped without vllm or
ray)."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from qarl.config import load_config  # noqa: E402
from qarl.parallel import RayEngines  # noqa: E402
from qarl.quant import export_state  # noqa: E402
from qarl.train.phases import train_examples  # noqa: E402
from qarl.train.data import sampling_params
from qarl.train.folder import open_run
from qarl.train.policy import build_engine  # noqa: E402
from qarl.train.sft import warm_start  # noqa: E402

FIELDS = ["prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logp"]


def test_two_vllm_workers_sample_what_one_vllm_engine_samples(ray_session, tmp_path):
    """tiny, w8a8-int8, fake alignment: after the same weight push, two VLLMEngines in Ray
    actors (shards with row offsets and the batch's prompt width) give a RolloutBatch
    torch.equal to one in-process VLLMEngine's, every field: vLLM's per-request seeds follow
    the row, and its int8 GEMMs do not depend on the other requests. Each actor wrote its
    starting policy into its own folder."""
    overrides = {"run.output_dir": str(tmp_path), "rollout.engine": "vllm", "quant.align": "fake"}
    one = load_config("tiny", {**overrides, "run.name": "one"})
    two = load_config("tiny", {**overrides, "run.name": "two", "dist.rollout_workers": 2})
    with open_run(one, learner=copy.deepcopy(warm_start(one))) as (_, policy, data):
        policy.sync.push()
        G = one.rollout.group_size
        examples = train_examples(data.task, one.run.seed, 1, one.rollout.batch_size // G)
        prompts = [ids for ids in data.prompts.encode_prompts(examples) for _ in range(G)]
        prompts = [p[2:] if i % 7 == 3 else p for i, p in enumerate(prompts)]  # other widths
        want = policy.engine.generate(prompts, sampling_params(one.rollout), seed=7)
        state = export_state(policy.learner.model)
    engines = RayEngines(partial(build_engine, two, run_dir=tmp_path / "two"), 2)
    try:
        engines.load_weights(state)
        got = engines.generate(prompts, sampling_params(two.rollout), seed=7)
    finally:
        engines.close()
    for field in FIELDS:
        assert torch.equal(getattr(want, field), getattr(got, field)), field
    assert want.finish_reasons == got.finish_reasons
    assert sorted(p.name for p in (tmp_path / "two" / "vllm_policy").iterdir()) == ["worker0", "worker1"]
