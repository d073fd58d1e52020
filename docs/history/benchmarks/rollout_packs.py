"""What it does to a default-recipe step that the engine and the learner's replayer drop their
packs after the step's rollouts (`Engine.release_caches`, called by `rl_step` before the
update) instead of holding them through the update: one JSON object.

    .venv/bin/python benchmarks/rollout_packs.py --steps 7            # both arms, one process
    .venv/bin/python benchmarks/rollout_packs.py --steps 4 --only kept       # peak memory of one
    .venv/bin/python benchmarks/rollout_packs.py --steps 4 --only released   # arm per process

With both arms they step in turn in one process (benchmarks/step_time.py), which reads the
seconds; the peak RSS of a process is the larger arm's, so the memory reading takes one arm per
process (`--only`). "kept" is qarl before the release: its engine and replayer keep the packs
until the next generate / score rebuilds them for the pushed weights.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile

from step_time import measure  # benchmarks/ is sys.path[0] when run

from qarl.native import machine
from qarl.native.memory import tune_allocator

ARMS = ("released", "kept")


def keep(name: str, policy) -> None:
    """The "kept" arm: release_caches does nothing for this policy's engine and replayer."""
    if name == "kept":
        for engine in (policy.engine, policy.learner.replayer):
            engine.release_caches = lambda: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="steps per arm, the first a warm-up")
    parser.add_argument("--only", choices=ARMS, default=None, help="run this arm alone")
    args = parser.parse_args()
    tune_allocator()
    arms = [(name, {}) for name in ARMS if args.only in (None, name)]
    with tempfile.TemporaryDirectory() as out:
        result = measure("default", arms, args.steps, None, out, prepare=keep)
    peak = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    print(json.dumps({**result, "steps": args.steps, "machine": machine(),
                      "peak_rss_gib": peak if args.only else None,
                      "unit": "seconds per step (mean of steps 2..N); peak RSS in GiB"}, indent=1))


if __name__ == "__main__":
    main()
