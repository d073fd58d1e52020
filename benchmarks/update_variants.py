"""The update's cost of two learner choices qarl makes, against the alternative, on the default
recipe: one JSON object with the seconds per step of policies built in one process and
stepped in turn (as benchmarks/step_time.py does), "qarl" and one per variant:

- "held": each kernel-mode layer whose forward runs on codes (W8A8 int8 on a CPU) reads, in
  its backward, a dequantized copy cached per weight version for every layer through the
  step (as before 42b8f1b), instead of dequantizing one layer at a time;
- "dense-embedding": the tied embedding's lookup takes the dense [vocab, hidden] gradient
  (nn.Embedding's default) instead of its rows (`qarl.train.setup.sparse_tied_embedding`).

    .venv/bin/python benchmarks/update_variants.py --steps 7
    .venv/bin/python benchmarks/update_variants.py --steps 7 --variants held
"""

from __future__ import annotations

import argparse
import json
import tempfile
from contextlib import ExitStack

from qarl.config import load_config
from qarl.native import machine
from qarl.native.memory import tune_allocator

VARIANTS = ("held", "dense-embedding")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="steps per arm, the first a warm-up")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, of {VARIANTS}")
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if unknown := sorted(set(variants) - set(VARIANTS)):
        parser.error(f"unknown variants {unknown}; valid: {list(VARIANTS)}")
    from qarl.quant.linear import QuantLinear
    from qarl.train.setup import open_run
    from qarl.train.trainer import rl_step

    tune_allocator()
    rows: dict[str, list[dict]] = {name: [] for name in ["qarl", *variants]}
    with tempfile.TemporaryDirectory() as out, ExitStack() as stack:
        runs = []
        for name in rows:
            config = load_config("default", {"run.output_dir": out, "run.name": name,
                                             "run.resume": False, "log.progress": False,
                                             "eval.size": 8})
            _, policy, data = stack.enter_context(open_run(config))
            model = policy.learner.model
            if name == "held":
                for layer in model.modules():
                    if isinstance(layer, QuantLinear):
                        layer._dequantize = lambda qw, dtype, layer=layer: layer.dequantized(dtype)
            elif name == "dense-embedding":
                model.model.embed_tokens.sparse = False
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
