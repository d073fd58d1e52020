"""`qarl parity`: exact kernel alignment, the full-precision floor, the 100x claim, CLI output,
the routing replay rows of a mixture-of-experts model.

One module-scoped matrix on the zoo's `tiny` model (all schemes x all alignments, 8 prompts,
12 new tokens at temperature 1) feeds the property tests; the CLI tests run smaller ones.
"""

from __future__ import annotations

import json

import pytest
import torch

from qarl.cli import main
from qarl.config import QuantSection
from qarl.quant import SCHEMES
from qarl.cli.parity_matrix import (
    ALIGNS, DECODE_REPLAY, FULL_SEQUENCE, arm_row, check_names, format_table, parity_matrix,
    run_arms,
)

QUANTIZED = [s for s in SCHEMES if not SCHEMES[s].is_identity]
ROW_KEYS = {
    "scheme", "align", "engine", "path", "mean_abs_dlogp", "max_abs_dlogp", "k3_kl", "seq_ratio_mean",
    "seq_ratio_min", "seq_ratio_max", "by_position", "num_tokens", "seconds", "bit_exact",
    "routing_replay", "routing_disagree_frac", "lora_rank",
}


@pytest.fixture(scope="module")
def arms(tiny_dir):
    """{(scheme, align, path): Arm} for the whole matrix on `tiny`."""
    found = run_arms(str(tiny_dir), list(SCHEMES), ALIGNS, num_prompts=8, max_new_tokens=12,
                     temperature=1.0, seed=0)
    return {(a.scheme, a.align, a.path): a for a in found}


def test_matrix_has_every_arm(arms):
    """Each quantized scheme has a decode-replay arm per alignment plus a kernel full-sequence
    arm; scheme none has one decode-replay and one full-sequence arm (the floor)."""
    expected = {(s, a, DECODE_REPLAY) for s in QUANTIZED for a in ALIGNS}
    expected |= {(s, "kernel", FULL_SEQUENCE) for s in QUANTIZED}
    expected |= {("none", "naive", DECODE_REPLAY), ("none", "naive", FULL_SEQUENCE)}
    assert set(arms) == expected


@pytest.mark.parametrize("scheme", QUANTIZED)
def test_kernel_alignment_decode_replay_is_bit_exact(arms, scheme):
    """With kernel alignment the learner's decode-replay logprobs equal the engine's sampler
    logprobs bit for bit (padding included), for every format on CPU."""
    arm = arms[(scheme, "kernel", DECODE_REPLAY)]
    assert arm.batch.response_mask.sum() > 0
    assert torch.equal(arm.old_logp, arm.batch.rollout_logp)
    row = arm_row(arm)
    assert row["max_abs_dlogp"] == 0.0 and row["k3_kl"] == 0.0 and row["bit_exact"]
    assert row["seq_ratio_min"] == row["seq_ratio_max"] == 1.0


def test_full_precision_floor_is_exact(arms):
    """Scheme none: a full-precision learner replaying the decode path reproduces a
    full-precision engine's logprobs bit for bit."""
    arm = arms[("none", "naive", DECODE_REPLAY)]
    assert torch.equal(arm.old_logp, arm.batch.rollout_logp)


def test_full_sequence_floor_is_rounding_only(arms):
    """Scheme none, one teacher-forced forward instead of the decode path: only reduction
    order differs (attention over a KV cache vs a causal pass, GEMM shapes), so |Δlogp| stays
    at fp32 rounding of a log-softmax over the vocabulary: <= 1e-5 (measured ~1e-6)."""
    row = arm_row(arms[("none", "naive", FULL_SEQUENCE)])
    assert row["max_abs_dlogp"] <= 1e-5


@pytest.mark.parametrize("scheme", QUANTIZED)
def test_kernel_is_100x_below_naive(arms, scheme):
    """Kernel alignment's mean |Δlogp| is at most 1e-2 x the naive (align naive) setup's, and
    the naive setup really does mismatch (the comparison is not 0 <= 0)."""
    naive = arm_row(arms[(scheme, "naive", DECODE_REPLAY)])["mean_abs_dlogp"]
    kernel = arm_row(arms[(scheme, "kernel", DECODE_REPLAY)])["mean_abs_dlogp"]
    assert naive > 1e-4
    assert kernel <= 1e-2 * naive


@pytest.mark.parametrize("scheme", QUANTIZED)
def test_fake_alignment_sits_between(arms, scheme):
    """Fake alignment (float emulation of the quantizer) is reported with finite metrics and
    never mismatches more than the naive setup on average."""
    fake = arm_row(arms[(scheme, "fake", DECODE_REPLAY)])
    naive = arm_row(arms[(scheme, "naive", DECODE_REPLAY)])
    assert all(torch.isfinite(torch.tensor(fake[k])) for k in ("mean_abs_dlogp", "k3_kl"))
    assert fake["mean_abs_dlogp"] <= naive["mean_abs_dlogp"]


def test_same_batch_for_every_alignment(arms):
    """Within a scheme every alignment scores the one batch the engine sampled."""
    for scheme in QUANTIZED:
        batches = {id(arms[(scheme, a, DECODE_REPLAY)].batch) for a in ALIGNS}
        assert len(batches) == 1


def test_cli_json_rows(tiny_dir, capsys):
    """`qarl parity --json` prints a JSON list, one object per (scheme, align, path) with the
    documented keys; position buckets are non-empty ranges of response positions."""
    code = main(["parity", "--model", str(tiny_dir), "--schemes", "none,w8a8-int8",
                 "--aligns", "naive,kernel", "--prompts", "2", "--max-new-tokens", "10", "--json"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["scheme"], r["align"], r["path"]) for r in rows] == [
        ("none", "naive", DECODE_REPLAY), ("none", "naive", FULL_SEQUENCE),
        ("w8a8-int8", "naive", DECODE_REPLAY), ("w8a8-int8", "kernel", DECODE_REPLAY),
        ("w8a8-int8", "kernel", FULL_SEQUENCE),
    ]
    for row in rows:
        assert set(row) == ROW_KEYS
        assert row["num_tokens"] > 0 and set(row["by_position"]) <= {"0-7", "8-15"}
    assert rows[3]["max_abs_dlogp"] == 0.0 and rows[3]["bit_exact"]


def test_lora_rows_keep_kernel_alignment_exact(tiny_dir, capsys):
    """`qarl parity --lora-rank 8`: sampler and learners carry the same planted, nonzero
    adapters; kernel decode-replay rows stay bit exact in every format, fake and naive rows
    measure their usual mismatch, and the rows and table name the rank."""
    code = main(["parity", "--model", str(tiny_dir), "--aligns", "naive,fake,kernel",
                 "--prompts", "2", "--max-new-tokens", "8", "--lora-rank", "8", "--json",
                 "--no-full-sequence"])
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["lora_rank"] for r in rows} == {8}
    kernel = [r for r in rows if r["align"] == "kernel"]
    assert {r["scheme"] for r in kernel} == set(QUANTIZED)
    assert all(r["bit_exact"] and r["max_abs_dlogp"] == 0.0 for r in kernel)
    assert all(r["max_abs_dlogp"] > 0 for r in rows if r["align"] == "naive" and r["scheme"] != "none")
    assert "lora r" in format_table(rows).splitlines()[0]


def test_cli_table(tiny_dir, capsys):
    """Without --json the CLI prints a table: a header and one line per row, exact zeros as
    "0" and small numbers in scientific notation."""
    assert main(["parity", "--model", str(tiny_dir), "--schemes", "w4a16-int4", "--aligns",
                 "kernel", "--prompts", "2", "--max-new-tokens", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["scheme", "align", "path"]
    assert len(lines) == 3
    assert lines[1].split()[3] == "0" and lines[1].split()[9] == "yes"


def test_cli_device_places_sampler_and_learners(tiny_dir, capsys):
    """`--device cpu` runs the matrix on the named device (`benchmarks/gpu_check.sh` runs it
    with `cuda`): kernel alignment stays bit exact there."""
    assert main(["parity", "--model", str(tiny_dir), "--schemes", "w8a8-int8", "--aligns",
                 "kernel", "--prompts", "2", "--max-new-tokens", "4", "--device", "cpu",
                 "--no-full-sequence", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["bit_exact"] and row["max_abs_dlogp"] == 0.0


def test_format_table_notation():
    """Tiny numbers print in scientific notation, larger ones as decimals, zero as 0."""
    row = dict(scheme="s", align="a", path="p", engine="local", mean_abs_dlogp=3.1e-7, max_abs_dlogp=0.0,
               k3_kl=0.25, seq_ratio_mean=1.0, seq_ratio_min=1.0, seq_ratio_max=1.0,
               by_position={"0-7": 2e-4}, bit_exact=False, num_tokens=3, seconds=0.5)
    cells = format_table([row]).splitlines()[1].split()
    assert cells[3:6] == ["3.10e-07", "0", "0.2500"] and cells[10] == "2.00e-04"


@pytest.mark.parametrize("flag, bad, valid", [("--schemes", "w8a8-int9", "w8a8-int8"),
                                               ("--aligns", "kernal", "kernel")])
def test_bad_names_are_clear_errors(capsys, flag, bad, valid):
    """An unknown scheme or alignment exits with status 2 before any model is loaded, naming
    the bad value and the valid ones."""
    assert main(["parity", "--model", "no-such-model", flag, bad]) == 2
    err = capsys.readouterr().err
    assert bad in err and valid in err and "valid" in err
    with pytest.raises(ValueError, match="valid"):
        parity_matrix("no-such-model", schemes=["w8a8-int9"])


def _small_arms(tiny_dir, quant=None):
    arms = run_arms(str(tiny_dir), ["w8a8-int8"], ("naive", "kernel"), num_prompts=4,
                    max_new_tokens=8, include_full_sequence=False, quant=quant)
    return {a.align: a for a in arms}


def test_recipe_exclude_reaches_learner_and_engine(tiny_dir):
    """A recipe's quant.exclude is honoured on both sides, as the trainer builds them: with
    layer 0 excluded the kernel learner's QuantLinear set is the default set minus exactly
    layer 0's projections, the naive learner has none, the kernel replay stays bit-exact, and
    the engine sampled with other weights (the naive mismatch is not the default's)."""
    default = _small_arms(tiny_dir)
    excluded = _small_arms(tiny_dir, QuantSection(exclude=["model.layers.0."]))
    layer0 = {n for n in default["kernel"].learner_layers if n.startswith("model.layers.0.")}
    assert layer0
    assert set(excluded["kernel"].learner_layers) == set(default["kernel"].learner_layers) - layer0
    assert default["naive"].learner_layers == excluded["naive"].learner_layers == ()
    kernel = excluded["kernel"]
    assert torch.equal(kernel.old_logp, kernel.batch.rollout_logp)
    assert arm_row(excluded["naive"])["mean_abs_dlogp"] != arm_row(default["naive"])["mean_abs_dlogp"]


def test_cli_recipe_sets_model_scheme_and_quant_keys(tiny_dir, capsys):
    """`qarl parity RECIPE --section.key=value ...` measures the recipe's model and scheme (the
    default --schemes) with its include / exclude / options: an exclude override changes the
    naive row, and the kernel row stays bit-exact."""
    recipe = ["tiny", f"--model.name={tiny_dir}", "--quant.scheme=w4a16-int4",
              "--quant.options={group_size=32}"]
    flags = ["--aligns", "naive,kernel", "--prompts", "2", "--max-new-tokens", "6",
             "--no-full-sequence", "--json"]
    assert main(["parity", *recipe, *flags]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(["parity", *recipe, *flags, "--quant.exclude=['mlp']"]) == 0
    excluded = json.loads(capsys.readouterr().out)
    for rows in (plain, excluded):
        assert [(r["scheme"], r["align"]) for r in rows] == [("w4a16-int4", "naive"),
                                                            ("w4a16-int4", "kernel")]
        assert rows[1]["bit_exact"]
    assert excluded[0]["mean_abs_dlogp"] != plain[0]["mean_abs_dlogp"]


def test_options_a_scheme_does_not_take_are_clear_errors(tiny_dir, capsys):
    """Quant options are checked against every scheme measured, before any model is loaded:
    the error names the scheme, the option and the valid ones."""
    with pytest.raises(ValueError, match=r"'w8a8-int8' takes no quant option\(s\) \['group_size'\]"):
        check_names(["w4a16-int4", "w8a8-int8"], ["kernel"], {"group_size": 32})
    assert main(["parity", "tiny", "--model", "no-such-model", "--schemes", "w4a16-int4,w8a8-int8",
                 "--quant.scheme=w4a16-int4", "--quant.options={group_size=32}"]) == 2
    assert "takes no quant option(s) ['group_size']" in capsys.readouterr().err


@pytest.mark.slow
def test_smollm2_kernel_exact_and_100x_below_naive():
    """On the real smollm2-135m (two formats, 4 prompts, 8 tokens): kernel alignment's decode
    replay is bit-exact and the naive setup mismatches by more than 100x kernel's mean."""
    found = list(run_arms("smollm2-135m", ["w8a8-int8", "w4a16-int4"], ("naive", "kernel"),
                          num_prompts=4, max_new_tokens=8, include_full_sequence=False))
    arms = {(a.scheme, a.align): a for a in found}
    for scheme in ("w8a8-int8", "w4a16-int4"):
        kernel = arms[(scheme, "kernel")]
        assert torch.equal(kernel.old_logp, kernel.batch.rollout_logp)
        naive = arm_row(arms[(scheme, "naive")])["mean_abs_dlogp"]
        assert naive > 1e-4 and arm_row(kernel)["mean_abs_dlogp"] <= 1e-2 * naive


@pytest.fixture(scope="module")
def moe_rows(tiny_moe_dir):
    """Rows of tiny-moe (schemes none and w4a16-int4, every alignment, 6 prompts, 12 tokens)."""
    return parity_matrix(str(tiny_moe_dir), ["none", "w4a16-int4"], ALIGNS, num_prompts=6,
                         max_new_tokens=12)


def test_moe_rows_come_without_and_with_routing_replay(moe_rows):
    """A MoE model gets every (scheme, align, path) row twice, routing replay off then on;
    decode-replay rows carry a routing disagreement fraction in [0, 1], full-sequence rows
    none (they record no routing)."""
    keys = [(r["scheme"], r["align"], r["path"], r["routing_replay"]) for r in moe_rows]
    expected = [("none", "naive", p, replay) for replay in (False, True)
                for p in (DECODE_REPLAY, FULL_SEQUENCE)]
    expected += [("w4a16-int4", "naive", DECODE_REPLAY, r) for r in (False, True)]
    expected += [("w4a16-int4", "fake", DECODE_REPLAY, r) for r in (False, True)]
    expected += [("w4a16-int4", "kernel", p, replay) for replay in (False, True)
                 for p in (DECODE_REPLAY, FULL_SEQUENCE)]
    assert keys == expected
    for r in moe_rows:
        assert set(r) == ROW_KEYS
        disagree = r["routing_disagree_frac"]
        assert (disagree is None) == (r["path"] == FULL_SEQUENCE)
        assert disagree is None or 0.0 <= disagree <= 1.0


def test_moe_kernel_rows_are_exact_with_and_without_replay(moe_rows):
    """Kernel alignment on tiny-moe: decode replay reproduces the sampler's logprobs bit for
    bit and the learner's routers choose the engine's experts on every token (disagreement 0),
    with and without routing replay; the full-precision floor too."""
    for r in moe_rows:
        if r["path"] == DECODE_REPLAY and (r["align"] == "kernel" or r["scheme"] == "none"):
            assert r["bit_exact"] and r["max_abs_dlogp"] == 0.0, r
            assert r["routing_disagree_frac"] == 0.0, r


def test_moe_naive_rows_disagree_on_routing(moe_rows):
    """Naive int4 rollouts on tiny-moe: the full-precision learner picks other experts than
    the engine on some tokens, with replay on too (its routers' own top-k, given the replayed
    experts of the layers below), and its logprobs mismatch."""
    naive = [r for r in moe_rows if (r["scheme"], r["align"]) == ("w4a16-int4", "naive")]
    assert len(naive) == 2
    assert naive[0]["routing_disagree_frac"] > 0.05 and naive[1]["routing_disagree_frac"] > 0.05
    assert all(r["mean_abs_dlogp"] > 1e-3 for r in naive)


def test_moe_table_has_routing_columns(moe_rows):
    """The table of MoE rows shows the replay flag and the disagreement after the path;
    a dense table keeps its columns."""
    lines = format_table(moe_rows).splitlines()
    assert lines[0].split()[:5] == ["scheme", "align", "path", "replay", "route≠"]
    assert lines[1].split()[3:5] == ["no", "0.0000"] and lines[2].split()[3:5] == ["no", "-"]
    dense = [{**r, "routing_replay": None, "routing_disagree_frac": None} for r in moe_rows[:1]]
    assert format_table(dense).splitlines()[0].split()[3] == "mean|Δ|"


@pytest.mark.slow
def test_smollm2_moe_kernel_exact_with_and_without_replay():
    """On the upcycled smollm2-135m-moe (w8a8-int8, 4 prompts, 8 tokens): kernel alignment's
    decode replay is bit-exact with the engine's experts on every token, with and without
    routing replay; the naive learner routes some tokens elsewhere and mismatches."""
    rows = parity_matrix("smollm2-135m-moe", ["w8a8-int8"], ("naive", "kernel"), num_prompts=4,
                         max_new_tokens=8, include_full_sequence=False)
    assert [(r["align"], r["routing_replay"]) for r in rows] == [
        ("naive", False), ("naive", True), ("kernel", False), ("kernel", True)]
    for r in rows[2:]:
        assert r["bit_exact"] and r["routing_disagree_frac"] == 0.0
    assert rows[0]["routing_disagree_frac"] > 0 and rows[0]["mean_abs_dlogp"] > 1e-3
