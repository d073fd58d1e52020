"""LoRA next to full fine-tuning on the default recipe, one sitting: per arm and seed the
held-out accuracy before -> after (deployed W8A8 policy and master weights), wall time and peak
RSS of the `qarl train` child, the mean phase seconds of steps 2.. (step 1 warms caches), and
the megabytes each weight sync sends; one JSON object.

    .venv/bin/python benchmarks/lora_vs_full.py                      # seeds 0 1 2
    .venv/bin/python benchmarks/lora_vs_full.py --rank 16 --lora-lr 2e-4 --seeds 0

Runs one child at a time, full fine-tuning first, then LoRA (`--lora.rank`, its learning rate
`--lora-lr`: 10x the recipe's 2e-5 by default, the usual LoRA rule; alpha = 2 x rank). Extra
arguments are `qarl train` overrides applied to both arms.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from default_runs import commit, run_seed

PHASES = ("generate", "reward", "old_logp", "update", "sync")


def step_figures(run: Path) -> dict:
    """Mean phase seconds and step seconds over steps 2.., sync megabytes of steps 1 and 2.."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    steps = [r for r in rows if r.get("kind") == "train"]
    later = steps[1:] or steps
    mean = lambda key: sum(r.get(key, 0.0) for r in later) / len(later)  # noqa: E731
    phases = {p: round(mean(f"time/{p}"), 3) for p in PHASES}
    return {"seconds_per_step": round(sum(phases.values()), 3), "phases": phases,
            "sync_mb_first": round(steps[0]["sync/megabytes"], 3),
            "sync_mb_per_step": round(mean("sync/megabytes"), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lora-lr", type=float, default=2e-4)
    parser.add_argument("--keep", type=Path, default=None, help="keep the run folders here")
    args, overrides = parser.parse_known_args()
    from qarl.native import machine

    arms = {"full": [], f"lora-r{args.rank}": [f"--lora.rank={args.rank}",
                                                f"--train.lr={args.lora_lr}"]}
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        root = args.keep or Path(scratch)
        for arm, extra in arms.items():
            out = root / arm
            out.mkdir(parents=True, exist_ok=True)
            results[arm] = [{**run_seed(seed, out, [*overrides, *extra]),
                             **step_figures(out / f"seed{seed}")} for seed in args.seeds]
    print(json.dumps({"commit": commit(), "overrides": overrides, "machine": machine(),
                      "arms": results}, indent=1))


if __name__ == "__main__":
    main()
