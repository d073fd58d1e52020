"""A finished `qarl compare` folder's table, from its compare.json: per arm, the deployed
policy's held-out accuracy by seed (mean ± half the range), the master weights' accuracy, the
gap closed, and the training means of the mismatch, clips, band drops, error-token rates and
seconds per step, as one JSON object, with what the table lets a reader judge (`reading`: how
far one evaluation moves, each arm against the baseline seed by seed, where the trust band and
the clips acted); `--results` also writes the table and that reading into docs/results.md
(section `compare-RECIPE` unless `--key`), so a new comparison regenerates the table instead of
leaving it stale.

    .venv/bin/qarl compare tbpo --jobs 2                            # the runs
    .venv/bin/python benchmarks/compare_table.py runs/tbpo          # the table's figures as JSON
    .venv/bin/python benchmarks/compare_table.py runs/tbpo --results   # and write docs/results.md

The recipe's name is the folder's (`qarl compare RECIPE` writes into run.output_dir/RECIPE).
The held-out seeds' runs (compare.held_out_seeds) are a second table, never in the first.
A figure no arm logged (GRPO arms have no trust band) is '-' in its arm's row, and a column no
arm has is left out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# (column, compare.json figures, format of their means over seeds); "gap_closed_pct" is the
# arm's own entry, the others its figures' means
COLUMNS = [("master", ("accuracy_master",), "{:.2f}"),
           ("gap closed", ("gap_closed_pct",), "{:.0f} %"),
           ("mean \\|Δlogp\\|", ("abs_diff_mean",), "{:.4f}"),
           ("clipped (A < 0)", ("clip_frac", "clip_frac_neg"), "{:.3f} ({:.3f})"),
           ("band drops", ("band_drop",), "{:.3f}"), ("garbled", ("garbled",), "{:.3f}"),
           ("low-prob tokens", ("lowprob_tokens",), "{:.4f}"),
           ("repeated 4-grams", ("rep_ngram",), "{:.3f}"), ("truncated", ("truncated",), "{:.3f}"),
           ("codes changed / step", ("changed_code_frac",), "{:.3%}"),
           ("s/step", ("time_step",), "{:.1f}")]
NOTES = ("Deployed: the deployed policy's held-out accuracy at the last evaluation (the "
         "quantized engine's; full precision's in an arm without quantization), mean ± half "
         "the range over seeds, each seed's in brackets; master: the full-precision master "
         "weights' (mean over seeds); gap closed: how much of the baseline's gap to the "
         "reference the arm's mean deployed accuracy closes. The other columns are means over "
         "training steps, then over seeds: mean |Δlogp| between the learner's and the "
         "sampler's logprobs; the clipped share of tokens (of sequences under TBPO's "
         "sequence-level loss; in brackets, of those with A < 0); the share of sequences the "
         "trust band dropped; the error-token rates of the training rollouts; the share of the "
         "deployed codes each push changed; seconds per step. qarl/report/README.md defines "
         "each figure.")


def figures(table: dict, part: str = "arms") -> dict:
    """{arm: {"seeds", "deployed": [per seed], "mean", "half_range", figure: mean, ...}} of
    compare.json's `arms` (the development seeds) or `held_out` (the held-out seeds)."""
    out = {}
    for arm, entry in (table.get(part) or {}).items():
        figs = entry["figures"]
        deployed = figs["accuracy_deployed"]["values"]
        before = (figs.get("accuracy_deployed_first") or {}).get("values") or []
        out[arm] = {"seeds": entry["seeds"], "deployed": deployed, "before": before,
                    "master": (figs.get("accuracy_master") or {}).get("values") or [],
                    "master_before": (figs.get("accuracy_master_first") or {}).get("values")
                    or [],
                    "mean": sum(deployed) / len(deployed) if deployed else None,
                    "half_range": (max(deployed) - min(deployed)) / 2 if deployed else None,
                    **{key: figs[key]["mean"] if key in figs else entry.get(key)
                       for _, keys, _ in COLUMNS for key in keys}}
    return out


def arm_name(arm: str, table: dict) -> str:
    role = {table.get("reference"): " (reference)", table.get("baseline"): " (baseline)"}
    return f"`{arm}`{role.get(arm, '')}"


def markdown(rows: dict, table: dict) -> str:
    """The arms' rows; the columns some arm has a value for."""
    seeds = " / ".join(map(str, next(iter(rows.values()))["seeds"]))
    shown = [c for c in COLUMNS if any(None not in [r[k] for k in c[1]] for r in rows.values())]
    head = ["arm", f"deployed (seeds {seeds})", *(label for label, _, _ in shown)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for arm, row in rows.items():
        values = " / ".join(f"{v:g}" for v in row["deployed"])
        deployed = "-" if row["mean"] is None else (
            f"{row['mean']:.3f} ± {row['half_range']:.3f} ({values})")
        cells = [arm_name(arm, table), deployed]
        for _, keys, fmt in shown:
            means = [row[key] for key in keys]
            cells.append("-" if None in means else fmt.format(*means))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def glance(rows: dict, table: dict, recipe: str) -> tuple[str, str] | None:
    """(what, reading): the reference and baseline arms' mean deployed accuracy and the best
    other arm's, with the share of the gap it closes."""
    measured = {arm: row["mean"] for arm, row in rows.items() if row["mean"] is not None}
    reference, baseline = table.get("reference"), table.get("baseline")
    others = {arm: mean for arm, mean in measured.items() if arm not in (reference, baseline)}
    if not others:
        return None
    best = max(others, key=others.get)
    named = [f"{role} `{arm}` {measured[arm]:.3f}" for role, arm in
             (("reference", reference), ("baseline", baseline)) if arm in measured]
    closed = rows[best].get("gap_closed_pct")
    closed = "" if closed is None else f" ({closed:.0f} % of the gap closed)"
    reading = "; ".join([*named, f"best other arm `{best}` {others[best]:.3f}{closed}"])
    return f"`qarl compare {recipe}`: deployed held-out accuracy", reading


def paired(rows: dict, arm: str, other: str) -> list[float] | None:
    """arm's deployed accuracy minus other's, seed by seed (None unless both have every seed)."""
    a, b = rows.get(arm), rows.get(other)
    if not a or not b or a["seeds"] != b["seeds"]:
        return None
    if not (len(a["deployed"]) == len(b["deployed"]) == len(a["seeds"])):
        return None
    return changes(a["deployed"], b["deployed"])


def beyond_noise(diffs: list[float], noise: float | None) -> bool:
    """Several seeds, one sign, and each seed's difference larger than the noise."""
    return noise is not None and len(diffs) > 1 and (
        all(d > noise for d in diffs) or all(d < -noise for d in diffs))


def verdict(diffs: list[float], noise: float | None) -> str:
    """Whether seed-by-seed differences agree in sign, and whether each exceeds the noise."""
    if len(diffs) == 1:
        return "one seed"
    if all(d > 0 for d in diffs) or all(d < 0 for d in diffs):
        side = "above" if diffs[0] > 0 else "below"
        if noise is None:
            return f"{side} in every seed"
        return f"{side} in every seed, " + ("each by more than the noise"
                                             if beyond_noise(diffs, noise)
                                             else "not every seed beyond the noise")
    return "no consistent sign"


def signed(values: list[float]) -> str:
    return " / ".join(f"{v:+.3f}" for v in values)


def changes(after: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before)]


def reading(rows: dict, table: dict) -> list[str]:
    """The figures a reader needs to judge the table, computed from it: how far one evaluation
    moves (every seed's runs start from the same weights, evaluated with each seed's sampling:
    the widest spread of the reference's and the baseline's starts), each arm against the
    baseline seed by seed, each arm's deployed and master change from its own start, and where
    the trust band and the clips acted. Rules, not judgement: a difference counts as
    consistent only when every seed agrees in sign, and as beyond the noise only when each
    seed's exceeds that spread."""
    lines = []
    baseline, reference = table.get("baseline"), table.get("reference")
    starts = {arm: row["before"] for arm, row in rows.items()
              if len(row["before"]) == len(row["seeds"]) > 1}
    spreads = {arm: max(starts[arm]) - min(starts[arm]) for arm in (reference, baseline)
               if arm in starts}
    noise = max(spreads.values()) if spreads else None
    if spreads:
        scored = "; ".join(f"`{arm}` {min(starts[arm]):.3f} to {max(starts[arm]):.3f}"
                           for arm in spreads)
        lines.append(f"Evaluation noise: every seed's runs start from the same weights, "
                     f"evaluated once per seed before training: {scored} (deployed policy). "
                     f"A difference within the widest spread ({noise:.3f}) is within one "
                     "evaluation's noise.")
    beyond, fell = [], []  # arms beyond the noise in every seed: vs the baseline; masters
    for arm in rows:
        if arm == baseline:
            continue
        diffs = paired(rows, arm, baseline)
        if diffs is None:
            continue
        if beyond_noise(diffs, noise):
            beyond.append(f"`{arm}` ({'above' if diffs[0] > 0 else 'below'})")
        mean = sum(diffs) / len(diffs)
        text = (f"`{arm}` − `{baseline}`, seed by seed: {signed(diffs)} (mean {mean:+.3f}; "
                f"{verdict(diffs, noise)})")
        if arm in starts:
            moved = changes(rows[arm]["deployed"], starts[arm])
            text += f"; its own change from the start: {signed(moved)}"
        lines.append(text + ".")
    masters = {arm: changes(row["master"], row["master_before"]) for arm, row in rows.items()
               if row["master"] and len(row["master"]) == len(row["master_before"])
               == len(row["seeds"]) and arm != reference}
    if masters:
        lines.append("The full-precision master weights' change from the start, seed by seed: "
                     + "; ".join(f"`{arm}` {signed(moved)}" for arm, moved in masters.items())
                     + ".")
        fell = [f"`{arm}` ({'rose' if moved[0] > 0 else 'fell'})"
                for arm, moved in masters.items() if beyond_noise(moved, noise)]
    if noise is not None:  # measured only where several seeds started
        summary = ("Beyond the noise in every seed, against the baseline's deployed accuracy: "
                   + (", ".join(beyond) if beyond else "no arm"))
        if masters:
            summary += ("; in the master weights' change from the start: "
                        + (", ".join(fell) if fell else "no arm"))
        lines.insert(1, summary + ".")
    band = {arm: row for arm, row in rows.items() if row.get("band_drop") is not None}
    for arm, row in band.items():
        lines.append(f"`{arm}`: the trust band dropped {row['band_drop']:.3f} of the sequences; "
                     f"clipped {row['clip_frac']:.3f} of the sequences "
                     f"({row['clip_frac_neg']:.3f} of those with A < 0).")
    if reference in rows and baseline in rows and rows[reference]["mean"] is not None:
        gap = rows[reference]["mean"] - rows[baseline]["mean"]
        lines.append(f"The gap to close: `{reference}` − `{baseline}` = {gap:+.3f} in mean "
                     "deployed accuracy.")
    return lines


def arms_note(table: dict) -> str:
    """One line per arm: its overrides of the recipe."""
    return "\n".join(f"- `{arm}`: `{json.dumps(entry.get('overrides') or {})}`"
                     for arm, entry in table["arms"].items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path,
                        help="a finished qarl compare folder (has compare.json)")
    parser.add_argument("--results", action="store_true",
                        help="write the table into docs/results.md")
    parser.add_argument("--key", default=None,
                        help="the results page's section (default: compare-RECIPE, RECIPE the "
                        "folder's name)")
    parser.add_argument("--machine", default=None,
                        help="with --results: the machine class the runs ran on (default: this "
                        "machine's, benchmarks/results_page.py machine_class)")
    parser.add_argument("--wall-s", type=float, default=None,
                        help="with --results: the whole qarl compare command's wall seconds, as "
                        "timed around it, for the notes")
    parser.add_argument("--warm-start", choices=("cached", "included"), default="included",
                        help="with --wall-s: whether that time includes training the recipe's "
                        "warm start or found it cached")
    parser.add_argument("--warm-start-s", type=float, default=None,
                        help="with --warm-start cached: the seconds the warm start takes from "
                        "an empty $QARL_HOME (qarl sft RECIPE, timed alone), added to give the "
                        "comparison's time from a fresh machine")
    args = parser.parse_args()
    source = args.folder / "compare.json"
    if not source.exists():
        raise SystemExit(f"{source} does not exist: run `qarl compare RECIPE` (or `qarl report "
                         f"{args.folder}`) first")
    table = json.loads(source.read_text())
    if table.get("unfinished"):
        raise SystemExit(f"{source}: unfinished runs {table['unfinished']}; the same qarl "
                         "compare command resumes them")
    if not table["arms"]:
        raise SystemExit(f"{source} has no arms: `qarl report {args.folder}` rewrites it")
    rows, held_out = figures(table), figures(table, "held_out")
    if args.results:
        from results_page import this_command, write_section

        recipe = args.folder.resolve().name
        body = markdown(rows, table)
        if held_out:
            body += ("\n\nThe held-out seeds (compare.held_out_seeds), kept out of the recipe's "
                     "development and out of the table above:\n\n" + markdown(held_out, table))
        for title, part in (("the table", rows), ("the held-out seeds' table", held_out)):
            lines = reading(part, table) if part else []
            if lines:
                body += (f"\n\nRead from {title}:\n\n"
                         + "\n".join(f"- {line}" for line in lines))
        runs = sum(len(entry["seeds"]) for part in ("arms", "held_out")
                   for entry in (table.get(part) or {}).values())
        wall = "" if args.wall_s is None else (
            f" The whole `qarl compare {recipe}` command ({runs} runs) took "
            f"{args.wall_s / 60:.0f} minutes wall, "
            + ("its warm start included." if args.warm_start == "included"
               else "its warm start found in the cache (not included)."))
        if args.wall_s is not None and args.warm_start == "cached" and args.warm_start_s:
            wall += (f" `qarl sft {recipe}` from an empty $QARL_HOME (the model's preparation "
                     f"included) took {args.warm_start_s / 60:.0f} minutes alone: "
                     f"{(args.wall_s + args.warm_start_s) / 60:.0f} minutes in all.")
        notes = (f"From the finished runs of `qarl compare {recipe}` in `{args.folder}`.{wall} "
                 f"{NOTES} "
                 f"The arms' overrides of the recipe:\n\n{arms_note(table)}")
        write_section(args.key or f"compare-{recipe}", f"Comparison: the {recipe} recipe",
                      this_command(), body, notes=notes,
                      glance=glance(rows, table, recipe), machine=args.machine)
    print(json.dumps({"folder": str(args.folder), "arms": rows, "held_out": held_out,
                      "reading": reading(rows, table),
                      "reading_held_out": reading(held_out, table)}, indent=1))


if __name__ == "__main__":
    main()
