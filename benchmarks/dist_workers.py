"""RL step time on `tiny` with 1 (in-process) vs N Ray rollout workers, or with learner
ranks placed locally or by Ray, as one JSON object.

For each arm, the recipe's policy is built (Ray actors and learner ranks started and given
the weights before timing), one untimed step warms up, then `--steps` steps of `rl_step` are
timed; the output holds the mean seconds per step and per phase (`time/generate`,
`time/update`, `time/sync`, ...), the one-off start-up (`setup_s`: Ray, the actors, the
ranks), what rank 0 holds of the training state (`training_state_mb`: `rank0_*_mb`) and the load average
before and after. Ray runs a local cluster with `--cpus` CPUs.
On a machine with fewer cores than engines plus learner, more processes cannot be faster:
the figure is what the transport costs.

    nice -n 19 .venv/bin/python benchmarks/dist_workers.py --workers 1 2 --steps 3
    nice -n 19 .venv/bin/python benchmarks/dist_workers.py --workers 1 --ranks 2 \
        --placement local ray --steps 3
    nice -n 19 .venv/bin/python benchmarks/dist_workers.py --workers 1 --ranks 2 \
        --strategy replicate fsdp --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
from torch.distributed.tensor import DTensor

from qarl.config import load_config
from qarl.native import machine
from qarl.train.learner.follow import FsdpLearner, learner_on_ranks
from qarl.train.folder import open_run
from qarl.train.sft import warm_start
from qarl.train.trainer import rl_step


def measure(workers: int, ranks: int, placement: str, strategy: str, steps: int,
            output_dir: str) -> dict:
    config = load_config("tiny", {"run.output_dir": output_dir,
                                  "run.name": f"w{workers}-r{ranks}-{placement}-{strategy}",
                                  "dist.rollout_workers": workers, "dist.learner_ranks": ranks,
                                  "dist.learner_placement": placement,
                                  "dist.learner_strategy": strategy})
    learner = warm_start(config)
    start = time.perf_counter()
    with open_run(config, learner=learner) as (_, policy, data):
        with learner_on_ranks(config, policy.learner) as policy.learner:
            policy.sync.push()
            setup_s = time.perf_counter() - start
            rl_step(policy, data, config, step=0)  # warm-up: plans, first pushes
            rows = []
            for step in range(1, steps + 1):
                began = time.perf_counter()
                metrics = rl_step(policy, data, config, step)
                rows.append({"step_s": time.perf_counter() - began,
                             **{k: v for k, v in metrics.items() if k.startswith("time/")}})
            held = training_state_mb(policy.learner)
    mean = {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in rows[0]}
    return {"rollout_workers": workers, "learner_ranks": ranks, "placement": placement,
            "strategy": strategy, "setup_s": round(setup_s, 2), **mean, **held}


def training_state_mb(learner) -> dict[str, float]:
    """MiB rank 0 holds of the trainable weights (its shards under FSDP) and of the optimizer
    state, between steps (gradients are freed after each step); under FSDP rank 0 also holds
    its whole learner's weights (`whole_weights_mb`) for replay, sync and checkpoints."""
    inner = getattr(learner, "inner", learner)  # rank 0's LeadLearner wraps the rank's learner
    sharded = inner.sharded if isinstance(inner, FsdpLearner) else None
    model, opts = (sharded.model, sharded.optimizers) if sharded else (learner.model,
                                                                       learner.optimizers)

    def mb(tensors) -> float:
        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return round(sum(t.numel() * t.element_size() for t in local) / 2**20, 2)

    state = [v for opt in opts for entry in opt.state.values() for v in entry.values()
             if torch.is_tensor(v)]
    held = {"rank0_weights_mb": mb(model.parameters()), "rank0_optimizer_mb": mb(state)}
    if sharded:
        held["whole_weights_mb"] = mb(learner.model.parameters())
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--ranks", type=int, default=1, help="dist.learner_ranks of every arm")
    parser.add_argument("--placement", nargs="+", default=["local"], choices=["local", "ray"],
                        help="dist.learner_placement: one arm per value and worker count")
    parser.add_argument("--strategy", nargs="+", default=["replicate"],
                        choices=["replicate", "fsdp"],
                        help="dist.learner_strategy: one arm per value (with --ranks > 1)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=os.cpu_count())
    args = parser.parse_args()
    if max(args.workers) > 1 or "ray" in args.placement:
        import ray

        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as out:
        results = [measure(n, args.ranks, placement, strategy, args.steps, out)
                   for n in args.workers for placement in args.placement
                   for strategy in args.strategy]
    print(json.dumps({"machine": machine(), "ray_cpus": args.cpus, "steps": args.steps,
                      "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                      "results": results}, indent=1))


if __name__ == "__main__":
    main()
