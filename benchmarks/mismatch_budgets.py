"""Measure the mismatch budgets (qarl/train/budgets.py) and write qarl/train/budgets.json.

For each model and each scheme the engine serves, `qarl parity`'s decode-replay rows under
`fake` and `naive` alignment give the mean per-token |old_logp - rollout_logp| of a fresh
learner against the engine's samples (16 held-out prompts, up to --max-new-tokens tokens at
temperature 1). The budget of a (scheme, align) is --factor x the largest value over the
models. `kernel` alignment and the identity scheme are exact on qarl's own engine: their
budget is 0 by construction and not measured here. Budgets are per engine as `qarl parity`
labels it: "local", or vLLM with its dtype ("vllm float32"); `--engine vllm` runs in the
vLLM environment (`make test-vllm` creates it) and adds its budgets to the file. Prints the
table as JSON; --write writes it (with the machine it was measured on) to
qarl/train/budgets.json.

    .venv/bin/python benchmarks/mismatch_budgets.py --write          # tiny + SmolLM2
    .venv-vllm/bin/python benchmarks/mismatch_budgets.py --engine vllm --write
    .venv/bin/python benchmarks/mismatch_budgets.py --from-json tiny=t.json,smollm2-135m=s.json

`--from-json` takes `qarl parity --json` outputs instead of measuring (model=file, ...).
`--check RUN_DIR ...` measures nothing: for each run folder (or a folder of them, e.g. a
`qarl compare` output) it prints the largest per-step mismatch next to the budget of the run's
(scheme, align, engine), and exits 1 if a step is over it:

    .venv/bin/python benchmarks/mismatch_budgets.py --check runs/tbpo
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from qarl.native import machine
from qarl.train.budgets import BUDGETS_FILE


def measure(model: str, engine: str, max_new_tokens: int) -> list[dict]:
    from qarl.cli.parity_matrix import arm_row, run_arms
    from qarl.rollout import ENGINES

    schemes = [s for s in ENGINES[engine].schemes() if s != "none"]
    aligns = [a for a in ("fake", "naive") if a in ENGINES[engine].aligns]
    return [arm_row(arm) for arm in run_arms(model, schemes, aligns, 16, max_new_tokens,
                                             include_full_sequence=False, engine=engine)]


def budgets(rows_by_model: dict[str, list[dict]], factor: float) -> dict:
    """{engine label: {scheme: {align: {"budget", "measured": {model: value}}}}} from parity
    rows (the label names vLLM's dtype: "vllm float32")."""
    out: dict[str, dict] = {}
    for model, rows in rows_by_model.items():
        for row in rows:
            exact = row["align"] == "kernel" or row["scheme"] == "none"
            if row["path"] != "decode-replay" or exact:
                continue
            per_scheme = out.setdefault(row["engine"], {}).setdefault(row["scheme"], {})
            entry = per_scheme.setdefault(row["align"], {"measured": {}})
            entry["measured"][model] = round(row["mean_abs_dlogp"], 6)
    for per_scheme in out.values():
        for entry in (e for per_align in per_scheme.values() for e in per_align.values()):
            entry["budget"] = float(f"{factor * max(entry['measured'].values()):.4g}")
    return out


def check(paths: list[str]) -> int:
    """The largest mismatch of every run under `paths` against its budget (module docstring)."""
    from qarl.config import load_config
    from qarl.model import load_skeleton
    from qarl.train.budgets import mismatch_budget
    from qarl.train.policy import replay_is_exact

    checkpoint = ("step_", ".tmp_step_", "damaged_step_")  # a checkpoint's copy of the files
    runs = sorted({p.parent for path in paths for p in Path(path).rglob("metrics.jsonl")
                   if (p.parent / "config.toml").exists()
                   and not p.parent.name.startswith(checkpoint)})
    report, over = [], 0
    for run in runs:
        config = load_config(run / "config.toml")
        quant = config.quant
        exact = replay_is_exact(config, bool(load_skeleton(config.model.name).config.moe_layers))
        budget = mismatch_budget(quant.scheme, quant.align, config.rollout.engine, exact)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if r.get("kind") == "train"]
        entry = {"run": str(run), "scheme": quant.scheme, "align": quant.align, "steps": len(steps)}
        if budget is not None and steps:
            worst = max(r.get(budget.metric, 0.0) for r in steps)
            flagged = sum(budget.exceeded(r) is not None for r in steps)
            entry.update(metric=budget.metric, worst=worst, budget=budget.limit, over=flagged)
            over += flagged
        report.append(entry)
    print(json.dumps(report, indent=1))
    return int(over > 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2-135m")
    parser.add_argument("--engine", default="local")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--factor", type=float, default=3.0)
    parser.add_argument("--from-json", default=None, help="model=parity.json,... instead of "
                        "measuring")
    parser.add_argument("--write", action="store_true", help=f"write {BUDGETS_FILE.name}")
    parser.add_argument("--check", nargs="+", default=None, metavar="RUN_DIR",
                        help="check these runs' steps against their budgets instead")
    args = parser.parse_args()
    if args.check:
        raise SystemExit(check(args.check))
    if args.from_json:
        pairs = [p.split("=", 1) for p in args.from_json.split(",")]
        rows = {model: json.loads(Path(path).read_text()) for model, path in pairs}
    else:
        rows = {m: measure(m, args.engine, args.max_new_tokens) for m in args.models.split(",")}
    command = (f"benchmarks/mismatch_budgets.py --models {','.join(rows)} --engine "
               f"{args.engine} --max-new-tokens {args.max_new_tokens}")
    table = {
        "metric": "mismatch/abs_diff_mean",
        "factor": args.factor,
        "engines": {label: {"measured_with": command, "machine": machine(), "budgets": entry}
                    for label, entry in budgets(rows, args.factor).items()},
    }
    if args.write:
        if BUDGETS_FILE.exists():  # keep the other engines' budgets
            old = json.loads(BUDGETS_FILE.read_text())
            table["engines"] = {**old.get("engines", {}), **table["engines"]}
        BUDGETS_FILE.write_text(json.dumps(table, indent=1) + "\n")
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
