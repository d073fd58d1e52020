"""`write_report(folder)`: the comparison report of a `qarl compare` folder, from its files.

The folder holds one run folder per arm and seed, `ARM/seedK/`. A run counts once it is
finished (its summary.json exists); its numbers come from its metrics.jsonl only, and the
arms' order, overrides, reference, baseline and held-out seeds from the [compare] section of
its config.toml. The runs of held-out seeds are summarized apart, never with the others.
Written into the folder: report.md, compare.json and the PNG plots.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from qarl import jsonio
from qarl.errors import UserError
from qarl.report.compare import DEPLOYED, FIGURES, PHASES, Stat, summarize
from qarl.report.compare_plots import plot_comparison
from qarl.report.metrics_file import read_metrics

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

SEED_FOLDER = re.compile(r"seed(\d+)")


def find_runs(folder: Path) -> tuple[dict[str, dict[int, Path]], list[Path]]:
    """(arm -> seed -> finished run folder, unfinished run folders) under `folder`."""
    finished: dict[str, dict[int, Path]] = {}
    unfinished = []
    for metrics in sorted(Path(folder).glob("*/seed*/metrics.jsonl")):
        run, match = metrics.parent, SEED_FOLDER.fullmatch(metrics.parent.name)
        if match is None:
            continue
        if (run / "summary.json").exists():
            finished.setdefault(run.parent.name, {})[int(match.group(1))] = run
        else:
            unfinished.append(run)
    return finished, unfinished


def compare_section(runs: dict[str, dict[int, Path]]) -> dict[str, Any]:
    """The [compare] section of a finished run's config.toml ({} if none has one)."""
    for seeds in runs.values():
        for run in seeds.values():
            path = run / "config.toml"
            if path.exists():
                try:
                    section = tomllib.loads(path.read_text(encoding="utf-8")).get("compare")
                except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
                    raise UserError(f"{path} does not parse ({err}): the file is damaged; "
                                    "restore it from the run's newest checkpoint "
                                    "(step_NNNNNN/config.toml)") from None
                if section:
                    return section
    return {}


def split_held_out(runs: dict[str, dict[int, Any]], held_out_seeds: set[int]
                   ) -> tuple[dict[str, dict[int, Any]], dict[str, dict[int, Any]]]:
    """(development runs, held-out runs): arm -> seed -> rows, split by seed; an arm with no
    run on one side is absent there."""
    def side(keep) -> dict[str, dict[int, Any]]:
        picked = {arm: {seed: rows for seed, rows in seeds.items() if keep(seed)}
                  for arm, seeds in runs.items()}
        return {arm: seeds for arm, seeds in picked.items() if seeds}

    return side(lambda seed: seed not in held_out_seeds), side(lambda seed: seed in held_out_seeds)


def _cell(value: Stat | float | None, spec: str = ".3f", suffix: str = "") -> str:
    """'mean ± std' (or the mean alone for one seed), 'n/a' for no value."""
    if isinstance(value, Stat):
        if value.mean is None:
            return "n/a"
        text = f"{value.mean:{spec}}{suffix}"
        return text if value.std is None else f"{text} ± {value.std:{spec}}{suffix}"
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows), ""]


# The report's tables: (title, columns); a column is (header, figure name or summary key,
# format spec, suffix). A figure no run logged (e.g. garbled) has no column.
TABLES = [
    ("Held-out accuracy and mismatch", [
        ("accuracy (deployed policy)", DEPLOYED, ".3f", ""),
        ("accuracy (full-precision master)", "accuracy_master", ".3f", ""),
        ("gap closed", "gap_closed_pct", ".1f", " %"),
        ("mean abs dlogp", "abs_diff_mean", ".3g", ""),
        ("max abs dlogp", "abs_diff_max", ".3g", ""),
        ("k3-KL", "k3_kl", ".3g", ""),
        ("seq ratio mean", "seq_ratio_mean", ".4g", ""),
        ("seq ratio min", "seq_ratio_min", ".4g", ""),
        ("seq ratio max", "seq_ratio_max", ".4g", ""),
        ("entropy", "entropy", ".3g", ""),
        ("steps over the mismatch budget", "over_budget", ".3g", ""),
        ("steps a monitor alerted at", "monitor_alerts", ".3g", "")]),
    ("Error-token rates (training rollouts)", [
        ("training reward", "reward", ".3f", ""),
        ("repeated n-grams", "rep_ngram", ".3g", ""),
        ("repeat runs", "rep_run", ".3g", ""),
        ("truncated", "truncated", ".3g", ""),
        ("low-probability tokens", "lowprob_tokens", ".3g", ""),
        ("garbled", "garbled", ".3g", "")]),
    ("Clips and trust band (mean over training steps)", [
        ("clipped", "clip_frac", ".3g", ""),
        ("clipped, A > 0", "clip_frac_pos", ".3g", ""),
        ("clipped, A < 0", "clip_frac_neg", ".3g", ""),
        ("dual-clipped", "dual_clip_frac", ".3g", ""),
        ("band drops", "band_drop", ".3g", "")]),
    ("Seconds per training step, by phase", [
        *((phase, f"time_{phase}", ".2f", "") for phase in PHASES),
        ("step", "time_step", ".2f", ""),
        ("speed vs reference", "relative_speed", ".2f", "x")]),
]


def _name(arm: str | None) -> str:
    return f"`{arm}`" if arm else "none set"


def _value(entry: dict[str, Any], name: str) -> Stat | float | None:
    return entry["figures"][name] if name in entry["figures"] else entry[name]


def _rows(table: dict, columns: list) -> list[str]:
    """One table of `columns` over the arms of `table`; a figure no arm has is left out."""
    shown = [column for column in columns if column[1] not in FIGURES
             or any(e["figures"][column[1]].mean is not None for e in table.values())]
    return _table(["arm", *(column[0] for column in shown)],
                  [[f"`{arm}`", *(_cell(_value(entry, name), spec, suffix)
                                  for _, name, spec, suffix in shown)]
                   for arm, entry in table.items()])


def markdown(table: dict, section: dict[str, Any], unfinished: list[Path],
             plots: list[Path], held_out: dict | None = None) -> str:
    """report.md: the arms, the four tables (accuracy and mismatch, error tokens, clips and
    trust band, time) over the development seeds, the held-out seeds' accuracy table apart
    (when the folder has held-out runs) and the plots."""
    lines = ["# Comparison report", "",
             "Mean ± sample std over seeds of each run's figure (qarl/report/README.md says how "
             f"each is computed). Reference arm: {_name(section.get('reference'))}; baseline: "
             f"{_name(section.get('baseline'))}. Regenerate with `qarl report FOLDER`.", ""]
    lines += _table(["arm", "overrides", "seeds"], [
        [f"`{arm}`", f"`{json.dumps(section.get('arms', {}).get(arm, {}))}`",
         ", ".join(map(str, entry["seeds"]))] for arm, entry in table.items()])
    if unfinished:
        lines += ["Unfinished runs left out: " + ", ".join(f"`{r.parent.name}/{r.name}`"
                                                          for r in unfinished), ""]
    for title, columns in TABLES:
        lines += [f"## {title}", "", *_rows(table, columns)]
    if held_out:
        seeds = ", ".join(map(str, sorted({s for e in held_out.values() for s in e["seeds"]})))
        lines += ["## Held-out seeds", "",
                  f"Seeds {seeds} (compare.held_out_seeds), kept out of the recipe's "
                  "development: their runs count in no table above, and these figures are "
                  "theirs alone (gap closed against the reference and baseline of the same "
                  "seeds).", "", *_rows(held_out, TABLES[0][1])]
    lines += ["## Plots", "", *(f"![{p.stem}]({p.name})" for p in plots), ""]
    return "\n".join(lines)


def _arms_json(table: dict, section: dict[str, Any]) -> dict[str, Any]:
    return {arm: {
        "overrides": section.get("arms", {}).get(arm),
        "seeds": entry["seeds"],
        "gap_closed_pct": entry["gap_closed_pct"],
        "relative_speed": entry["relative_speed"],
        "figures": {name: {"mean": s.mean, "std": s.std, "values": s.values}
                    for name, s in entry["figures"].items()},
    } for arm, entry in table.items()}


def as_json(table: dict, section: dict[str, Any], unfinished: list[Path],
            held_out: dict | None = None) -> dict[str, Any]:
    """compare.json: every figure of every arm with its per-seed values, over the
    development seeds; `held_out`: the same over the held-out seeds alone (null without
    held-out runs)."""
    return {
        "reference": section.get("reference"),
        "baseline": section.get("baseline"),
        "unfinished": [f"{run.parent.name}/{run.name}" for run in unfinished],
        "arms": _arms_json(table, section),
        "held_out": _arms_json(held_out, section) if held_out else None,
    }


def check_folder(folder: Path) -> None:
    """Raise UserError unless `folder` can be a comparison folder: one that exists, and not a
    `qarl train` run folder (one holding config.toml)."""
    where = ("give the folder `qarl compare` printed (run.output_dir / run.name of its "
             "recipe, e.g. runs/compare)")
    if not folder.exists():
        raise UserError(f"{folder} does not exist; {where}")
    if not folder.is_dir():
        raise UserError(f"{folder} is a file, not a comparison folder; {where}")
    if (folder / "config.toml").is_file():
        raise UserError(f"{folder} is the run folder of a `qarl train` run (it holds "
                        f"config.toml), not a comparison folder of ARM/seedK runs; {where}")


def write_report(folder: str | Path) -> list[Path]:
    """Write report.md, compare.json and the PNG plots into `folder`; return their paths."""
    folder = Path(folder)
    check_folder(folder)
    finished, unfinished = find_runs(folder)
    if not finished:
        raise UserError(
            f"no finished runs under {folder} (expected ARM/seedK/metrics.jsonl with a "
            f"summary.json next to it, as `qarl compare` writes); {len(unfinished)} unfinished: "
            "give the folder `qarl compare` wrote, once a run of it has finished")
    section = compare_section(finished)
    order = [arm for arm in section.get("arms", {}) if arm in finished]
    order += sorted(arm for arm in finished if arm not in order)
    kept_out = set(section.get("held_out_seeds", []))
    runs, held_out_runs = split_held_out(
        {arm: {seed: read_metrics(finished[arm][seed] / "metrics.jsonl")
               for seed in sorted(finished[arm])} for arm in order}, kept_out)
    if not runs:
        raise UserError(f"{folder} holds finished runs of the held-out seeds "
                        f"{sorted(kept_out)} only; run the development seeds (compare.seeds) "
                        "too: the report sets the held-out seeds beside them")
    table = summarize(runs, section.get("reference"), section.get("baseline"))
    held_out = summarize(held_out_runs, section.get("reference"),
                         section.get("baseline")) if held_out_runs else None
    images = plot_comparison(runs, table, folder)
    (folder / "compare.json").write_text(jsonio.dumps(
        as_json(table, section, unfinished, held_out), indent=1))
    (folder / "report.md").write_text(markdown(table, section, unfinished, images, held_out))
    return [folder / "report.md", folder / "compare.json", *images]
