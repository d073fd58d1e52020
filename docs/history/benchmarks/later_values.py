"""What it saves that an optimizer step after the first reads logp's value from its own
gradient forward where that forward computes the scorer's bits (train.logp_path = 'forward',
fp32 gradient pass, no LoRA: `ForwardScorer.is_gradient_pass`), instead of running the
forward again without grad: one JSON object with the seconds per step of two policies built
in one process and stepped in turn (as benchmarks/step_time.py does), "own" (qarl's
behaviour) and "rescore" (the second forward, as before). Both arms take the same update to
the bit (tests/integration/test_logp_path.py); only the time differs.

    .venv/bin/python benchmarks/later_values.py --steps 4            # recipes/tbpo.toml's fake arm
    .venv/bin/python benchmarks/later_values.py --steps 4 --first rescore   # the other order
"""

from __future__ import annotations

import argparse
import json
import tempfile

from step_time import measure  # benchmarks/ is sys.path[0] when run

from qarl.native import machine
from qarl.native.memory import tune_allocator


def rescore(name: str, policy) -> None:
    """The "rescore" arm: the scorer never counts as the gradient pass."""
    if name == "rescore":
        policy.learner.replayer.is_gradient_pass = lambda compute, micro_batch_size: False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tbpo")
    parser.add_argument("--steps", type=int, default=4, help="steps per arm, the first a warm-up")
    parser.add_argument("--first", choices=("own", "rescore"), default="own",
                        help="the arm that steps first in each round (the ratios are against it)")
    args = parser.parse_args()
    tune_allocator()
    arms = [("own", {}), ("rescore", {})]
    with tempfile.TemporaryDirectory() as out:
        result = measure(args.recipe, arms if args.first == "own" else arms[::-1],
                         args.steps, None, out, prepare=rescore)
    print(json.dumps({**result, "recipe": args.recipe, "steps": args.steps,
                      "machine": machine(), "unit": "seconds per step (mean of steps 2..N)"},
                     indent=1))


if __name__ == "__main__":
    main()
