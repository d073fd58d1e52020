"""What it costs that a kernel-mode learner layer whose forward runs on codes (W8A8 int8 on a
CPU) dequantizes its weight in the backward, one layer at a time, instead of holding the
dequantized copy of every layer through the step: one JSON object with the update's seconds
per step of two policies built in one process and stepped in turn (as benchmarks/step_time.py
does), "layerwise" (qarl's behaviour) and "held" (each layer's backward reads the copy
cached per weight version, as before 42b8f1b), both with train.quant_backward = 'float' (the
backward on codes reads no dequantized weight).

    .venv/bin/python benchmarks/backward_dequant.py --steps 7
    .venv/bin/python benchmarks/backward_dequant.py --steps 7 --first held   # the other order
"""

from __future__ import annotations

import argparse
import json
import tempfile

from step_time import measure  # benchmarks/ is sys.path[0] when run

from qarl.native import machine
from qarl.native.memory import tune_allocator


def hold(name: str, policy) -> None:
    """The "held" arm: each learner layer's backward reads the per-version cached copy."""
    from qarl.quant.linear import QuantLinear

    def held(qw, dtype, layer):
        cache = layer._dequantized  # emptied when the layer quantizes its next weight version
        if dtype not in cache:
            cache[dtype] = QuantLinear._dequantize(layer, qw, dtype)
        return cache[dtype]

    if name == "held":
        for layer in policy.learner.model.modules():
            if isinstance(layer, QuantLinear):
                layer._dequantize = lambda qw, dtype, layer=layer: held(qw, dtype, layer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="steps per arm, the first a warm-up")
    parser.add_argument("--first", choices=("layerwise", "held"), default="layerwise",
                        help="the arm that steps first in each round (the ratios are against it)")
    args = parser.parse_args()
    tune_allocator()
    # the float backward, which reads W_hat (the backward on codes needs none)
    float_backward = {"train.quant_backward": "float"}
    arms = [("layerwise", float_backward), ("held", float_backward)]
    with tempfile.TemporaryDirectory() as out:
        result = measure("default", arms if args.first == "layerwise" else arms[::-1],
                         args.steps, None, out, prepare=hold)
    print(json.dumps({**result, "steps": args.steps, "machine": machine(),
                      "unit": "seconds per step (mean of steps 2..N)"}, indent=1))


if __name__ == "__main__":
    main()
