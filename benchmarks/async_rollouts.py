"""Seconds per RL step, synchronous vs one-step-off-policy rollouts (train.async_rollouts),
on the in-process engine and on Ray rollout workers, as one JSON object; and what async
would give where the engines have cores of their own, from the synchronous steps' phases.

Each arm builds its policy (Ray actors started and given the weights first), takes one
untimed step (first packs and pushes; under async also the first batch, generated before
the overlap starts), then `--steps` timed steps of `rl_step`: the wall seconds of the step
(`step`) and its phases. Under async, `generate` is the seconds the step's batch took to
generate (in the background, during the step before) and `generate_wait` the part of the
step that waited for generation (the overlap's remainder); a synchronous step waits for all
of its generation. The arms take their steps in turn (arm A step 2, arm B step 2, ...), so a
machine whose speed drifts moves every arm alike.

On one machine the background generation and the learner share the cores: the overlap
gains only where one of them leaves cores idle (Python between kernels, the reward
workers, the sync), and loses where both compete for the same cores and caches.
`remote` is the arithmetic for engines on other machines, with the generation seconds
measured here: a synchronous step is generate + reward + old_logp + update + sync; an async
step max(generate, reward + old_logp' + update) + sync, the push waiting for the generation
(plus the transfer of the weights, which `sync` here holds for the in-process engine), where
old_logp' is the async arm's: a stale batch is replayed whole, while a synchronous step
whose replay is exact audits a fraction of its rows (train.audit_fraction).

    nice -n 19 .venv/bin/python benchmarks/async_rollouts.py --steps 4
    nice -n 19 .venv/bin/python benchmarks/async_rollouts.py --steps 4 --tokens 32 --results

`--results` writes the arms' means and the arithmetic into docs/results.md (section
`async-rollouts`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from contextlib import ExitStack

import qarl

qarl.ask_huge_pages()  # before torch loads, as the `qarl` command does (docs/performance.md)
from qarl.config import load_config, parse_overrides  # noqa: E402
from qarl.native import machine  # noqa: E402
from qarl.native.memory import tune_allocator  # noqa: E402

PHASES = ("generate", "generate_wait", "reward", "old_logp", "update", "sync")
# (arm name, overrides): sync and async, in this process and on two Ray rollout workers
ARMS = [("local-sync", {}), ("local-async", {"train.async_rollouts": True}),
        ("ray2-sync", {"dist.rollout_workers": 2}),
        ("ray2-async", {"dist.rollout_workers": 2, "train.async_rollouts": True})]


def measure(recipe: str, arms: list[tuple[str, dict]], steps: int, tokens: int | None,
            out: str, extra: dict | None = None) -> dict:
    from qarl.train.folder import open_run
    from qarl.train.sft import warm_start
    from qarl.train.trainer import async_rollouts, rl_step

    common = {"run.output_dir": out, "run.resume": False, "log.progress": False,
              "train.steps": steps + 2, **extra}
    if tokens is not None:
        common["rollout.max_new_tokens"] = tokens
    rows: dict[str, list[dict]] = {name: [] for name, _ in arms}
    with ExitStack() as stack:
        runs = []
        for name, overrides in arms:
            config = load_config(recipe, {**common, "run.name": name, **overrides})
            _, policy, data = stack.enter_context(open_run(config, learner=warm_start(config)))
            policy.sync.push()
            rollouts = async_rollouts(policy, data, config)
            if rollouts is not None:
                stack.callback(rollouts.close)
            runs.append((name, config, policy, data, rollouts))
        for step in range(steps + 1):
            for name, config, policy, data, rollouts in runs:
                began = time.perf_counter()
                metrics = rl_step(policy, data, config, step, rollouts)
                seconds = time.perf_counter() - began
                if step == 0:  # first packs and pushes; async: the first batch, not overlapped
                    continue
                wait = metrics.get("time/generate_wait", metrics["time/generate"])
                rows[name].append({"step": seconds,
                                   **{p: metrics.get(f"time/{p}", 0.0) for p in PHASES},
                                   "generate_wait": wait,
                                   "tokens": metrics["response/length_mean"]})
    means = {name: {k: round(sum(r[k] for r in rs) / len(rs), 3) for k in rs[0]}
             for name, rs in rows.items()}
    for name, m in means.items():
        if name.endswith("-sync"):
            partner = means.get(name.replace("-sync", "-async"), m)
            m["remote_sync"], m["remote_async"] = remote(m, partner["old_logp"])
    return means


def remote(m: dict, async_old_logp: float) -> tuple[float, float]:
    """(synchronous, async) seconds per step with the engines on other machines, from a
    synchronous arm's phases (module docstring) and the async arm's old_logp: a stale batch
    is replayed whole where a synchronous step may audit a fraction of its rows (measured
    beside the background generation here: an upper bound)."""
    learner = m["reward"] + m["old_logp"] + m["update"]
    stale = m["reward"] + async_old_logp + m["update"]
    return (round(m["generate"] + learner + m["sync"], 3),
            round(max(m["generate"], stale) + m["sync"], 3))


def write_results(result: dict, machine_line: str) -> None:
    """The arms' mean step and phases, each async arm against its synchronous one, and the
    arithmetic for engines elsewhere, into docs/results.md (section `async-rollouts`)."""
    from results_page import this_command, write_section

    arms = result["arms"]
    head = ["arm", "s/step", *PHASES, "speed vs sync"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in arms.items():
        base = arms.get(name.replace("-async", "-sync"))
        speed = f"{base['step'] / m['step']:.2f}x" if base and name.endswith("-async") else ""
        cells = [f"`{name}`", f"{m['step']:.2f}", *(f"{m[p]:.2f}" for p in PHASES), speed]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| engines on other machines, from the sync arm's phases | sync s/step | "
              "async s/step | speed |", "|---|---|---|---|"]
    for name, m in arms.items():
        if name.endswith("-sync"):
            a, b = m["remote_sync"], m["remote_async"]
            lines.append(f"| `{name}` | {a:.2f} | {b:.2f} | {a / b:.2f}x |")
    notes = (f"Recipe `{result['recipe']}`{result['tokens_note']}; seconds per step and per "
             f"phase, the mean of {result['steps']} steps after an untimed first one; arms "
             "interleaved step by step. `generate`: the seconds the step's batch took to "
             "generate (async: in the background, during the step before); `generate_wait`: "
             "the part of the step spent waiting for generation. `ray2`: two Ray rollout "
             "workers of one CPU each beside the learner. On one machine the background "
             "generation and the learner share the cores, so overlap gains only the time "
             "either leaves them idle. Engines elsewhere: sync = generate + reward + old_logp "
             "+ update + sync, async = max(generate, reward + old_logp' + update) + sync, with "
             "the phases of the sync arm, old_logp' the async arm's (a stale batch is "
             "replayed whole where a synchronous exact replay audits a fraction of the rows; "
             "measured beside the background generation, an upper bound) and no transfer "
             "time.")
    if result.get("shared"):
        notes += " Taken on a shared machine (another job running): the timings are noisy."
    write_section("async-rollouts", "One-step-off-policy rollouts: seconds per RL step",
                  this_command(), "\n".join(lines), notes=notes, machine=machine_line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tiny")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per arm")
    parser.add_argument("--tokens", type=int, default=None, help="rollout.max_new_tokens")
    parser.add_argument("--no-ray", action="store_true", help="the in-process arms only")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for every arm, e.g. quant.align=fake")
    parser.add_argument("--shared", action="store_true",
                        help="say in the results that another job shared the machine")
    parser.add_argument("--results", action="store_true",
                        help="write the table into docs/results.md (section async-rollouts)")
    args = parser.parse_args()
    tune_allocator()
    arms = [arm for arm in ARMS if not (args.no_ray and "dist.rollout_workers" in arm[1])]
    from results_page import machine_class

    machine_line = machine_class()  # before Ray starts: the driver's CPU affinity changes there
    if not args.no_ray:
        import ray

        # both Ray arms' actors live at once (the arms alternate), one CPU reserved each:
        # Ray counts 2 x 2 CPUs, of which one arm's two are in use at a time
        ray.init(num_cpus=max(os.cpu_count(), 4), include_dashboard=False, log_to_driver=False)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as out:
        extra = parse_overrides([f"--{kv}" for kv in args.set]) if args.set else {}
        means = measure(args.recipe, arms, args.steps, args.tokens, out, extra)
    result = {"machine": machine(), "recipe": args.recipe, "steps": args.steps, "set": args.set,
              "tokens": args.tokens, "loadavg_before": load_before,
              "loadavg_after": os.getloadavg(), "shared": args.shared, "arms": means,
              "unit": "seconds per step (mean of the timed steps)"}
    print(json.dumps(result, indent=1))
    if args.results:
        result["tokens_note"] = "".join(
            ([] if args.tokens is None else [f", rollout.max_new_tokens = {args.tokens}"])
            + [f", {kv}" for kv in args.set])
        write_results(result, machine_line)


if __name__ == "__main__":
    main()
