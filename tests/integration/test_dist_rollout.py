"""[dist] rollout workers on `tiny`: Ray actors sample exactly the tokens of one engine, also
when an actor dies mid-generation. One Ray session (2 CPUs) serves the whole module."""

from __future__ import annotations

import copy
import os
import signal
from functools import partial

import pytest
import torch

ray = pytest.importorskip("ray")

from qarl.config import load_config  # noqa: E402
from qarl.parallel import RayEngines  # noqa: E402
from qarl.quant import export_state  # noqa: E402
from qarl.lora.layers import adapter_state  # noqa: E402
from qarl.train.phases import train_examples  # noqa: E402
from qarl.train.data import sampling_params
from qarl.train.folder import open_run
from qarl.train.policy import build_engine  # noqa: E402
from qarl.train.sft import warm_start  # noqa: E402

FIELDS = ["prompt_ids", "prompt_mask", "response_ids", "response_mask", "rollout_logp"]


def _config(tmp_path, workers: int):
    return load_config("tiny", {"run.output_dir": str(tmp_path), "run.name": f"w{workers}",
                                "dist.rollout_workers": workers})


def _step_prompts(config, data, step: int) -> list[list[int]]:
    """The prompt list rl_step generates for `step` (each prompt group_size times)."""
    G = config.rollout.group_size
    examples = train_examples(data.task, config.run.seed, step, config.rollout.batch_size // G)
    return [ids for ids in data.prompts.encode_prompts(examples) for _ in range(G)]


def _generate(config, step: int, prompts=None):
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        policy.sync.push()
        prompts = prompts or _step_prompts(config, data, step)
        # some shorter prompts: shards of other widths must still pad like the whole batch
        prompts = [p[2:] if i % 7 == 3 else p for i, p in enumerate(prompts)]
        seed = config.run.seed * 100_003 + step
        batch = policy.engine.generate(prompts, sampling_params(config.rollout), seed=seed)
        replay, _ = policy.learner.replay(batch, sampling_params(config.rollout))
    return batch, replay


def test_two_rollout_workers_sample_what_one_engine_samples(ray_session, tmp_path):
    """tiny, step 0: rollout_workers = 2 gives a RolloutBatch torch.equal to the in-process
    engine's, every field (tokens, masks, padding, sampler logprobs, finish reasons), and the
    learner's whole-batch replay still equals the sharded sampler's logprobs bit for bit."""
    one, _ = _generate(_config(tmp_path, 1), step=0)
    two, replay = _generate(_config(tmp_path, 2), step=0)
    for field in FIELDS:
        assert torch.equal(getattr(one, field), getattr(two, field)), field
    assert one.finish_reasons == two.finish_reasons
    assert torch.equal(replay, two.rollout_logp)


def _dies_once(config, marker: str, worker: int):
    """build_engine, but the first engine to reach a decode step (in any actor) kills its own
    process there: a rollout actor dying mid-generation."""
    engine = build_engine(config, worker)

    def die_the_first_time():
        try:  # O_EXCL: of two actors reaching here at once, exactly one creates it and dies
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    engine.stop_check = die_the_first_time
    return engine


def test_killed_rollout_actor_is_restarted_with_the_same_tokens(ray_session, tmp_path):
    """An actor killed in the middle of its shard is restarted by Ray, gets the last pushed
    weights again, and reruns the shard with the same seed and rows: the joined batch is
    torch.equal to an engine that never died."""
    config = _config(tmp_path, 2)
    learner = warm_start(config)
    with open_run(_config(tmp_path, 1), learner=copy.deepcopy(learner)) as (_, policy, data):
        policy.sync.push()
        prompts = _step_prompts(config, data, step=1)
        want = policy.engine.generate(prompts, sampling_params(config.rollout), seed=7)
        state = export_state(policy.learner.model)
    engines = RayEngines(partial(_dies_once, config, str(tmp_path / "died")), 2)
    try:
        engines.load_weights(state)
        pids = [ray.get(w.pid.remote()) for w in engines.workers]
        got = engines.generate(prompts, sampling_params(config.rollout), seed=7)
        assert (tmp_path / "died").exists() and engines.restarts == 1
        assert [ray.get(w.pid.remote()) for w in engines.workers] != pids
    finally:
        engines.close()
    for field in FIELDS:
        assert torch.equal(getattr(want, field), getattr(got, field)), field


def test_rollout_workers_without_room_fail_instead_of_waiting(ray_session):
    """Workers that need more CPUs than the cluster has are never placed: RayEngines raises
    after its start timeout, naming the count, what each needs and `ray status`."""
    with pytest.raises(RuntimeError, match=r"2 of 2 rollout workers did not start within 2 s.*"
                                           r"64 CPU.*ray status"):
        RayEngines(_never_built, 2, cpus_per_worker=64, start_timeout_s=2)


def _never_built(index: int):
    raise AssertionError("an actor without room was built")


def _stale_after_first_push(config, worker: int):
    """build_engine, but worker 1 installs only the first push it gets: a worker left with
    stale codes (a dropped refit)."""
    engine = build_engine(config, worker)
    if worker == 1:
        install, pushes = engine.load_weights, []

        def first_only(state):
            if not pushes:
                install(state)
            pushes.append(1)

        engine.load_weights = first_only
    return engine


def test_a_rollout_worker_with_stale_codes_breaks_the_contract(ray_session, tmp_path):
    """Each actor computes its own digests after a push; when worker 1 skipped the push
    after an update, WeightSync names worker 1 and the layers whose codes changed, while the
    first push (both workers current) passes."""
    from qarl.quant.contract import ContractBroken
    from qarl.train.sync import WeightSync

    config = _config(tmp_path, 2)
    with open_run(_config(tmp_path, 1), learner=copy.deepcopy(warm_start(config))) as (
            _, policy, _):
        learner = policy.learner.model
    engines = RayEngines(partial(_stale_after_first_push, config), 2)
    try:
        sync = WeightSync(learner, engines)
        assert sync.push()["contract/seconds"] > 0
        layer = "model.layers.0.mlp.up_proj"
        with torch.no_grad():
            weight = learner.get_submodule(layer).weight
            weight.add_(0.05 * torch.randn_like(weight))
        with pytest.raises(ContractBroken, match=rf"rollout worker 1 .*{layer} "
                                                 r"\(codes, scales\)"):
            sync.push()
    finally:
        engines.close()


def test_lora_adapters_reach_every_worker_and_survive_a_restart(ray_session, tmp_path):
    """A LoRA run's pushes on Ray workers: the whole state, then adapters alone (trained B):
    the workers sample exactly what the in-process engine with the same pushes samples, also
    when an actor dies mid-shard after the partial push (it gets the whole state again, then
    the adapters, before its shard reruns), and the learner's replay equals their logprobs."""
    lora = {"lora.rank": 4}
    config = load_config("tiny", {"run.output_dir": str(tmp_path), "run.name": "lora", **lora})
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        policy.sync.push()
        with torch.no_grad():
            for name, t in adapter_state(policy.learner.model).items():
                if name.endswith("lora_B"):
                    t.normal_(0, 0.05, generator=torch.Generator().manual_seed(3))
        assert policy.sync.push()["sync/megabytes"] < 1  # the adapters only
        prompts = _step_prompts(config, data, step=1)
        want = policy.engine.generate(prompts, sampling_params(config.rollout), seed=7)
        whole, adapters = export_state(policy.learner.model), adapter_state(policy.learner.model)
        replay, _ = policy.learner.replay(want, sampling_params(config.rollout))
    assert torch.equal(replay, want.rollout_logp)
    engines = RayEngines(partial(_dies_once, config, str(tmp_path / "died")), 2)
    try:
        engines.load_weights(whole)
        engines.load_weights({k: v.clone() for k, v in adapters.items()}, partial=True)
        got = engines.generate(prompts, sampling_params(config.rollout), seed=7)
        assert (tmp_path / "died").exists() and engines.restarts == 1
    finally:
        engines.close()
    for field in FIELDS:
        assert torch.equal(getattr(want, field), getattr(got, field)), field


def test_delta_pushes_reach_every_worker_and_survive_a_restart(ray_session, tmp_path):
    """Delta sync on Ray workers: a whole push, then deltas after updates (each one's digests
    checked in every actor); an actor killed mid-shard after two deltas comes back with the
    whole push and both deltas replayed, so the joined batch is torch.equal to an in-process
    engine given the learner's state whole; the push after it is a delta again, and the
    restarted actor's digests pass."""
    from qarl.train.sync import WeightSync

    config = _config(tmp_path, 2)
    with open_run(_config(tmp_path, 1), learner=copy.deepcopy(warm_start(config))) as (
            _, policy, data):
        learner, prompts = policy.learner.model, _step_prompts(config, data, step=1)
        engines = RayEngines(partial(_dies_once, config, str(tmp_path / "died")), 2)
        try:
            assert not engines.crosses_machines  # one machine: 'auto' would not send deltas
            sync = WeightSync(learner, engines, delta=True)
            g = torch.Generator().manual_seed(0)
            flags = []
            for push in range(3):
                with torch.no_grad():  # a few weights each: deltas far below their bound
                    for p in learner.parameters():
                        moved = torch.rand(p.shape, generator=g) < 0.01 * (push > 0)
                        p.add_(1e-2 * torch.randn(p.shape, generator=g) * moved)
                flags.append(sync.push()["sync/delta"])
            assert flags == [0, 1, 1]
            got = engines.generate(prompts, sampling_params(config.rollout), seed=7)
            assert (tmp_path / "died").exists() and engines.restarts == 1
            assert engines.versions() == [3, 3]
            policy.sync.push()  # the in-process engine: the learner's state, whole
            want = policy.engine.generate(prompts, sampling_params(config.rollout), seed=7)
            with torch.no_grad():
                learner.get_submodule("model.layers.0.mlp.up_proj").weight.mul_(1.01)
            assert sync.push()["sync/delta"] == 1
        finally:
            engines.close()
    for field in FIELDS:
        assert torch.equal(getattr(want, field), getattr(got, field)), field


@pytest.mark.slow
def test_async_rollouts_on_two_workers_train_as_on_the_local_engine(ray_session, tmp_path):
    """train.async_rollouts (staleness 1) with 2 Ray rollout workers, the next batch generated
    by the actors while the learner updates: the same final weights, torch.equal, as the
    in-process engine's async run (the workers sample the one engine's tokens), and the
    staleness of every step after the first is 1."""
    from safetensors.torch import load_file

    from qarl.report import read_metrics
    from qarl.train.checkpoint import latest
    from qarl.train.trainer import train

    run = {"run.output_dir": str(tmp_path), "train.steps": 3, "rollout.batch_size": 16,
           "train.micro_batch_size": 8, "train.async_rollouts": True, "eval.size": 8,
           "eval.full_precision": False, "log.plot": False, "log.progress": False}
    weights = {}
    for workers in (1, 2):
        train("tiny", {**run, "run.name": f"w{workers}", "dist.rollout_workers": workers})
        weights[workers] = load_file(latest(tmp_path / f"w{workers}") / "model.safetensors")
    assert all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1])
    rows = [r for r in read_metrics(tmp_path / "w2" / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["async/staleness"] for r in rows] == [0.0, 1.0, 1.0]
