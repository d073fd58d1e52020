"""`rl_step` on the warm-started `tiny` model: what one step promises about the policy pair."""

from __future__ import annotations

import copy

import pytest
import torch

from qarl import native as nat
from qarl.config import load_config
from qarl.quant import QWeight, export_state, quant_layers
from qarl.quant import kernels as K
from qarl.train.folder import open_run
from qarl.train.sft import warm_start
from qarl.train.trainer import rl_step

PHASES = ["generate", "reward", "old_logp", "update", "sync"]
# Step 1, not 0: its 8 samples have a reward spread (step 0's all score 0, and a step without
# signal takes no update to check).
STEP = 1


def _config(tmp_path, **extra):
    return load_config("tiny", {"run.output_dir": str(tmp_path), "log.progress": False,
                                "rollout.batch_size": 8, "train.micro_batch_size": 4, **extra})


def test_step_pushes_the_updated_learner_to_the_engine(tmp_path):
    """After one step the engine holds exactly the codes and scales of the updated learner
    (sync is the step's last phase), the update moved the learner, the sampled tokens' replay
    matched the sampler bit for bit (kernel alignment), and every phase of docs/training.md
    was timed, in order."""
    config = _config(tmp_path)
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        pushed_before = {k: v.codes.clone() for k, v in export_state(policy.learner.model).items()
                         if isinstance(v, QWeight)}
        metrics = rl_step(policy, data, config, step=STEP)
        learner_codes = export_state(policy.learner.model)
        engine_layers = quant_layers(policy.engine.model)
    assert engine_layers and set(engine_layers) == set(quant_layers(policy.learner.model))
    for name, layer in engine_layers.items():
        pushed, held = learner_codes[f"{name}.weight"].tensors(), layer.qweight().tensors()
        assert pushed.keys() == held.keys()
        assert all(torch.equal(pushed[k], held[k]) for k in held), name
    assert any(not torch.equal(pushed_before[k], learner_codes[k].codes) for k in pushed_before)
    assert metrics["mismatch/abs_diff_max"] == 0.0
    assert [k.split("/", 1)[1] for k in metrics if k.startswith("time/")] == PHASES


def test_the_update_runs_without_the_rollouts_packs(tmp_path):
    """The engine and the learner's replayer hold no packs while the update runs (the weights
    they were built from are about to change): the update's peak memory does not hold them.
    The step still replays exactly."""
    config = _config(tmp_path)
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        held = []
        update = policy.learner.update

        def recording_update(*args):
            held.append((len(policy.engine._planner._packs),
                         len(policy.learner.passes.replayer._planner._packs)))
            return update(*args)

        policy.learner.update = recording_update
        metrics = rl_step(policy, data, config, step=STEP)
        assert policy.engine._planner._packs == {}  # nothing generated since the release
    assert held == [(0, 0)]
    assert metrics["mismatch/abs_diff_max"] == 0.0


def _replayed_rows(tmp_path, **extra) -> tuple[list[int], dict[str, float]]:
    """The number of rows of each replay of step STEP, and its metrics."""
    config = _config(tmp_path, **extra)
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        replayed_rows = []
        replayer = policy.learner.passes.replayer  # old_logp's and the later steps' values
        score = replayer.score_routing

        def counting_score(batch, sampling, replay=False):
            replayed_rows.append(batch.num_sequences)
            return score(batch, sampling, replay=replay)

        replayer.score_routing = counting_score
        metrics = rl_step(policy, data, config, step=STEP)
    return replayed_rows, metrics


def test_every_exact_logp_is_one_whole_batch_replay(tmp_path):
    """With algo.epochs = 3 and every row audited, the learner's decode path is replayed
    exactly three times per step (old_logp, then once before each later epoch), always on the
    whole sampled batch, never per micro-batch: a replay over other shapes is not exact
    (docs/alignment.md); the sampler's logprobs equal the whole replay bit for bit."""
    replayed, metrics = _replayed_rows(tmp_path, **{"algo.epochs": 3, "train.audit_fraction": 1.0})
    assert replayed == [8] * 3
    assert metrics["audit/abs_diff_max"] == 0.0 and metrics["audit/failed"] == 0.0


def test_kernel_alignment_replays_only_the_audited_rows_for_old_logp(tmp_path):
    """By default (kernel alignment) old_logp is the sampler's logprobs, checked on
    ceil(0.125 * 8) = 1 row of the step outside every 8th step; later epochs still replay the
    whole batch with the updated weights."""
    replayed, metrics = _replayed_rows(tmp_path, **{"algo.epochs": 2})
    assert replayed == [1, 8]
    assert metrics["audit/replayed_frac"] == 1 / 8 and metrics["audit/failed"] == 0.0
    assert metrics["mismatch/abs_diff_max"] == 0.0


def test_mini_batches_step_off_policy_after_one_whole_replay_each(tmp_path):
    """train.mini_batches = 2 with algo.epochs = 2: four optimizer steps per rollout batch,
    each after the first preceded by one replay of the whole batch (logp's exact value with
    the weights the steps before it left). The first step is on-policy (TBPO's ratio s = 1
    exactly, no clip); the later ones are not, and TBPO's 3e-4 / 4e-4 clip acts on them."""
    replayed, metrics = _replayed_rows(tmp_path, **{"train.mini_batches": 2, "algo.epochs": 2,
                                                    "algo.loss": "tbpo"})
    assert replayed == [1, 8, 8, 8] and metrics["mismatch/abs_diff_max"] == 0.0
    # a step whose every sequence left TBPO's clip band has no gradient: skipped, not taken
    assert metrics["policy/optimizer_steps"] + metrics["policy/skipped_steps"] == 4.0
    assert metrics["policy/optimizer_steps"] >= 2.0 and metrics["loss/clip_frac"] > 0.0
    _, on_policy = _replayed_rows(tmp_path / "one", **{"algo.loss": "tbpo"})
    assert on_policy["policy/optimizer_steps"] == 1.0 and on_policy["loss/clip_frac"] == 0.0
    assert on_policy["loss/seq_ratio_max"] == 1.0 == on_policy["loss/seq_ratio_min"]


def test_naive_alignment_always_replays_the_whole_batch(tmp_path):
    replayed, metrics = _replayed_rows(tmp_path, **{"quant.align": "naive"})
    assert replayed == [8] and metrics["audit/full_replay"] == 1.0
    assert metrics["mismatch/abs_diff_max"] > 0.0


def _update_of_one_step(tmp_path, compute_dtype: str, **extra) -> tuple[dict[str, float], dict]:
    config = _config(tmp_path / compute_dtype, **{"train.compute_dtype": compute_dtype, **extra})
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        before = {k: v.detach().clone() for k, v in policy.learner.model.named_parameters()}
        metrics = rl_step(policy, data, config, step=STEP)
        moved = {k: v.detach() - before[k] for k, v in policy.learner.model.named_parameters()}
    return metrics, moved


def test_a_bf16_gradient_pass_changes_gradients_only(tmp_path):
    """train.compute_dtype = 'bfloat16' samples the same batch and computes the same loss
    values (logp's value is the exact replay's, not the gradient pass's) as 'float32'; the
    update differs by bf16 rounding of the gradient: Adam's first step moves each weight by
    about lr * sign(grad), so the two updates agree on the direction of nearly every weight
    that moved, and their norms agree within a few percent."""
    m32, moved32 = _update_of_one_step(tmp_path, "float32")
    m16, moved16 = _update_of_one_step(tmp_path, "bfloat16")
    for key in m32:
        if key.startswith(("loss/", "reward/", "response/", "mismatch/", "audit/")):
            assert m16[key] == m32[key], key
    assert abs(m16["policy/grad_norm"] - m32["policy/grad_norm"]) <= 0.05 * m32["policy/grad_norm"]
    a = torch.cat([v.flatten() for v in moved32.values()])
    b = torch.cat([v.flatten() for v in moved16.values()])
    assert (a != 0).any()
    same_sign = (torch.sign(a) == torch.sign(b))[(a.abs() > 0.5 * a.abs().max())]
    assert same_sign.float().mean() >= 0.95
    assert abs(b.norm() - a.norm()) <= 0.05 * a.norm()


def test_the_backward_on_codes_changes_gradients_only(tmp_path):
    """train.quant_backward = 'codes' (int8 dL/dx, dL/dW on the activation codes) samples the
    same batch, computes the same loss values and keeps old_logp exact (the forward and the
    replay are untouched); the update differs from the float backward's by g's int8 rounding
    in dL/dx: as for a bf16 pass, Adam's first step agrees in direction on nearly every
    weight that moved, and in norm within a few percent."""
    mf, movedf = _update_of_one_step(tmp_path / "float", "float32",
                                     **{"train.quant_backward": "float"})
    mc, movedc = _update_of_one_step(tmp_path / "codes", "float32",
                                     **{"train.quant_backward": "codes"})
    for key in mf:
        if key.startswith(("loss/", "reward/", "response/", "mismatch/", "audit/")):
            assert mc[key] == mf[key], key
    assert mc["mismatch/abs_diff_max"] == 0.0
    assert abs(mc["policy/grad_norm"] - mf["policy/grad_norm"]) <= 0.05 * mf["policy/grad_norm"]
    a = torch.cat([v.flatten() for v in movedf.values()])
    b = torch.cat([v.flatten() for v in movedc.values()])
    assert (a != 0).any() and not torch.equal(a, b)
    same_sign = (torch.sign(a) == torch.sign(b))[(a.abs() > 0.5 * a.abs().max())]
    assert same_sign.float().mean() >= 0.95
    assert abs(b.norm() - a.norm()) <= 0.05 * a.norm()


def _update_with_cpu_gemm(tmp_path, monkeypatch, library: str, align: str):
    # the float backward, whose GEMMs the library runs: the backward on codes rounds g to
    # int8, which turns the libraries' last-bit differences into whole rounding steps
    monkeypatch.setenv(K.CPU_GEMM_ENV, library)
    return _update_of_one_step(tmp_path / library / align, "float32",
                               **{"quant.align": align, "train.quant_backward": "float"})


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
@pytest.mark.parametrize("align", ["kernel", "naive"])
def test_onednn_and_mkl_gradient_passes_take_the_same_step(tmp_path, monkeypatch, align):
    """The fp32 gradient pass by oneDNN (the AMD CPUs' choice: plain linears through
    LearnerLinears, the lm_head inside its checkpoint, QuantLinear's straight-through
    backward) and by MKL compute the same gradient up to fp32 summation order: the same batch
    and loss values, grad-norm within 1e-4, every weight moved the same way."""
    m_mkl, moved_mkl = _update_with_cpu_gemm(tmp_path, monkeypatch, "mkl", align)
    m_dnn, moved_dnn = _update_with_cpu_gemm(tmp_path, monkeypatch, "onednn", align)
    for key in m_mkl:
        if key.startswith(("loss/", "reward/", "response/", "mismatch/", "audit/")):
            assert m_dnn[key] == m_mkl[key], key
    assert abs(m_dnn["policy/grad_norm"] - m_mkl["policy/grad_norm"]) <= 1e-4 * m_mkl["policy/grad_norm"]
    a = torch.cat([v.flatten() for v in moved_mkl.values()])
    b = torch.cat([v.flatten() for v in moved_dnn.values()])
    assert (a != 0).any()
    # Adam's first step moves a weight by ~lr * sign(grad): only weights whose gradient is
    # near 0 (within rounding) may move differently
    big = a.abs() > 0.5 * a.abs().max()
    assert torch.equal(torch.sign(a)[big], torch.sign(b)[big])
    assert (b - a).norm() <= 1e-2 * a.norm()


@pytest.mark.skipif(not nat.available(), reason="native kernels")
def test_avx2_kernels_keep_the_replay_exact(tmp_path, monkeypatch):
    """With the native GEMMs forced to their AVX2 instruction sets and the learner's GEMMs to
    MKL (an AVX2-only CPU's paths, as far as this CPU can run them), a step's replay still
    equals the sampler bit for bit and the engine holds the learner's codes."""
    monkeypatch.setenv(K.CPU_GEMM_ENV, "mkl")
    f32, s8 = nat.f32_isa(), nat.s8_isa()
    try:
        assert nat.use_f32_isa("avx2") == "avx2" and nat.use_s8_isa("avx2") == "avx2"
        config = _config(tmp_path)
        with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
            metrics = rl_step(policy, data, config, step=STEP)
            learner_codes = export_state(policy.learner.model)
            engine_layers = quant_layers(policy.engine.model)
    finally:
        nat.use_f32_isa(f32)
        nat.use_s8_isa(s8)
    assert metrics["mismatch/abs_diff_max"] == 0.0 and metrics.get("audit/failed", 0.0) == 0.0
    for name, layer in engine_layers.items():
        assert torch.equal(learner_codes[f"{name}.weight"].codes, layer.qweight().codes), name


@pytest.mark.parametrize("align,compute", [("kernel", "float32"), ("naive", "float32"),
                                           ("kernel", "bfloat16")])
def test_gradient_checkpointing_takes_the_same_step(tmp_path, align, compute):
    """train.gradient_checkpointing recomputes each layer in backward inside the gradient
    pass's own context (its precision, its GEMM library), so the recomputed activations are
    the forward's bits and the update is exactly the one without it: the same metrics, every
    weight moved by the same amount (torch.equal)."""
    extra = {"quant.align": align}
    m_plain, moved_plain = _update_of_one_step(tmp_path / "plain" / align, compute, **extra)
    m_ckpt, moved_ckpt = _update_of_one_step(tmp_path / "ckpt" / align, compute, **extra,
                                             **{"train.gradient_checkpointing": True})
    assert any(bool((v != 0).any()) for v in moved_plain.values())
    for key in m_plain:
        if not key.startswith(("time/", "speed/")) and not key.endswith("seconds"):
            assert m_ckpt[key] == m_plain[key] or (m_plain[key] != m_plain[key]), key
    for name, moved in moved_plain.items():
        assert torch.equal(moved_ckpt[name], moved), name


TRUNCATING = {"rollout.top_p": 0.7, "rollout.top_k": 6, "rollout.min_p": 0.02,
              "rollout.temperature": 0.9}


def _scored_batches(policy) -> list:
    """Wraps the learner's replayer: the batches it scores are appended to the list returned."""
    seen, replayer = [], policy.learner.passes.replayer
    score = replayer.score_routing

    def recording(batch, sampling, replay=False):
        seen.append((batch, sampling))
        return score(batch, sampling, replay=replay)

    replayer.score_routing = recording
    return seen


@pytest.mark.parametrize("scheme", ["w8a8-int8", "w4a16-int4", "w8a8-fp8"])
def test_truncated_sampling_replays_the_sampler_bit_for_bit_under_kernel(tmp_path, scheme):
    """With top-k, top-p and min-p on, the step's batch carries the sampler's kept sets (fewer
    than 6 tokens at every position), the learner's audit replays under them and matches the
    sampler to the bit; every row replayed (audit_fraction 1) the mismatch is 0."""
    config = _config(tmp_path, **{"quant.scheme": scheme, **TRUNCATING,
                                  "train.audit_fraction": 1.0})
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        seen = _scored_batches(policy)
        metrics = rl_step(policy, data, config, step=STEP)
    batch, sampling = seen[0]
    assert sampling.truncates and batch.kept_counts is not None
    counts = batch.kept_counts[batch.response_mask]
    assert counts.min() >= 1 and counts.max() <= 6 and counts.float().mean() < 6
    assert metrics["mismatch/abs_diff_max"] == 0.0
    assert metrics["audit/full_replay"] == 0.0


def test_without_the_correction_the_learner_scores_the_whole_vocabulary(tmp_path):
    """rollout.truncation_correction = false: the learner gets no kept sets and untruncated
    settings, its replay is not exact by construction (every row replayed), and the
    mismatch is the log of the kept mass, so the learner's logprob is below the sampler's
    at every token that had more than one candidate."""
    config = _config(tmp_path, **TRUNCATING, **{"rollout.truncation_correction": False})
    with open_run(config, learner=copy.deepcopy(warm_start(config))) as (_, policy, data):
        seen = _scored_batches(policy)
        metrics = rl_step(policy, data, config, step=STEP)
    batch, sampling = seen[0]
    assert not sampling.truncates and batch.kept_counts is None
    assert metrics["audit/full_replay"] == 1.0 and metrics["mismatch/abs_diff_max"] > 0.0
