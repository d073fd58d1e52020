"""What it costs that a kernel-mode learner layer whose forward runs on codes (W8A8 int8 on a
CPU) dequantizes its weight in the backward, one layer at a time, instead of holding the
dequantized copy of every layer through the step: one JSON object with the update's seconds
per step of two policies built in one process and stepped in turn (as benchmarks/step_time.py
does), "layerwise" (qarl's behaviour) and "held" (each layer's backward reads the copy
cached per weight version, as before 42b8f1b).

    .venv/bin/python benchmarks/backward_dequant.py --steps 7
"""

from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import ExitStack

from qarl.config import load_config
from qarl.native import machine
from qarl.native.memory import tune_allocator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="steps per arm, the first a warm-up")
    args = parser.parse_args()
    from qarl.quant.linear import QuantLinear
    from qarl.train.setup import open_run
    from qarl.train.trainer import rl_step

    tune_allocator()
    rows: dict[str, list[dict]] = {"layerwise": [], "held": []}
    with tempfile.TemporaryDirectory() as out, ExitStack() as stack:
        runs = []
        for name in rows:
            config = load_config("default", {"run.output_dir": out, "run.name": name,
                                             "run.resume": False, "log.progress": False,
                                             "eval.size": 8})
            _, policy, data = stack.enter_context(open_run(config))
            if name == "held":
                for layer in policy.learner.model.modules():
                    if isinstance(layer, QuantLinear):
                        layer._dequantize = lambda qw, dtype, layer=layer: layer.dequantized(dtype)
            policy.sync.push()
            runs.append((name, config, policy, data))
        for step in range(args.steps):
            for name, config, policy, data in runs:
                metrics = rl_step(policy, data, config, step)
                if step > 0:
                    rows[name].append({k: metrics[f"time/{k}"] for k in ("update", "generate")})
    means = {name: {k: round(sum(r[k] for r in rs) / len(rs), 3) for k in rs[0]}
             | {"update_per_step": [round(r["update"], 2) for r in rs]}
             for name, rs in rows.items()}
    print(json.dumps({"arms": means, "steps": args.steps, "machine": machine(),
                      "unit": "seconds (mean of steps 2..N)"}, indent=1))


if __name__ == "__main__":
    main()
