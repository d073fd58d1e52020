"""What the old_logp phase saves by running the update's first gradient forward ahead
(`AlignedLearner.replay(for_update=True)`, train.logp_path = 'forward'): one JSON object with
the seconds per step, by phase, of two policies built in one process and stepped in turn (as
benchmarks/step_time.py does): "ahead" (qarl's behaviour: the first micro-batch's old_logp are
the values of the update's first forward, which the update then backpropagates) and "scored"
(every row scored by a forward without grad, then the update runs its forwards, as before).
Both compute the same bits (tests/integration/test_logp_path.py).

    .venv/bin/python benchmarks/forward_ahead.py --steps 3                    # recipes/tbpo.toml
    .venv/bin/python benchmarks/forward_ahead.py --steps 3 --set train.mini_batches=1
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile

from step_time import _arm, measure  # benchmarks/ is sys.path[0] when run

from qarl.native import machine
from qarl.native.memory import tune_allocator


def scored(name: str, policy) -> None:
    """The "scored" arm: the learner scores every row without grad (no head start)."""
    if name == "scored":
        policy.learner.train = None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tbpo")
    parser.add_argument("--steps", type=int, default=3, help="steps per arm, the first a warm-up")
    parser.add_argument("--set", default="", help="KEY=VALUE,... overrides of both arms")
    args = parser.parse_args()
    tune_allocator()
    overrides = _arm(f"x:{args.set}")[1]
    arms = [("ahead", overrides), ("scored", overrides)]
    with tempfile.TemporaryDirectory() as out:
        result = measure(args.recipe, arms, args.steps, None, out, prepare=scored)
    print(json.dumps({**result, "recipe": args.recipe, "overrides": overrides,
                      "steps": args.steps, "machine": machine(),
                      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                           / 2**20, 2),
                      "unit": "seconds per step (mean of steps 2..N)"}, indent=1))


if __name__ == "__main__":
    main()
