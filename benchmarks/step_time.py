"""Seconds per RL step, by phase, of two or more recipes measured side by side in one process,
as one JSON object: each arm's policy is built once, then the arms take their steps in turn
(arm A step 1, arm B step 1, arm A step 2, ...), so a machine whose speed drifts (as a shared
virtual machine's does) moves every arm alike and the ratios are read in one window. The arms
also share the process's heap, and the first arm pays for blocks the others leave in other
sizes, so in one process the arms' order moves their ratio. `--rounds R` runs each arm in a
process of its own instead, R rounds of one process per arm, the order of the arms reversed
every other round: the JSON has each round's figures and ratios, and the means over the rounds.

    .venv/bin/python benchmarks/step_time.py --steps 4                      # W8A8 vs none
    .venv/bin/python benchmarks/step_time.py --steps 4 --tokens 64          # longer responses
    .venv/bin/python benchmarks/step_time.py --steps 4 --tokens 64 --ignore-eos  # all 64 long
    .venv/bin/python benchmarks/step_time.py --arm w8a8: --arm none:quant.scheme=none \\
        --arm int4:quant.scheme=w4a16-int4
    .venv/bin/python benchmarks/step_time.py --recipe compare --steps 7 --ignore-eos \\
        --rounds 2 --arm qarl-grpo:quant.align=kernel --arm fp-grpo:quant.scheme=none

An arm is NAME:KEY=VALUE,KEY=VALUE (overrides of the recipe, `--recipe`, default `default`).
A recipe with SFT steps starts from its warm start, as `qarl train` does (trained first where
the cache lacks it). Step 1 of each arm is a warm-up (first packs, first pushes) and is left
out of the means (step 2 still faults the heap's pages in, which costs its update system
time: `--steps 6` dilutes it); `contract` is the per-sync digest check's share of `sync`
(docs/contract.md#a-digest-after-every-weight-push). `--ignore-eos` (as vLLM's throughput
benchmark does) makes every response run to `--tokens`: the arms then do the same work per step
whatever their policies write, so their step ratio is not a ratio of response lengths (the
responses' text past the end token is noise, and so are the rewards). The JSON names the
machine (CPU, ISA levels, threads) and the int8 GEMM chosen here, and each arm's
`quant_backward` (what its quantized layers' backward multiplies: train.quant_backward
resolved); `ratio` is each arm's mean step against the first arm's. `--results` also writes the
arms' means into docs/results.md (section `step-time`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import qarl

qarl.ask_huge_pages()  # before torch loads, as the `qarl` command does (docs/performance.md)
from qarl.config import load_config, parse_overrides  # noqa: E402
from qarl.native import machine  # noqa: E402
from qarl.native.memory import tune_allocator  # noqa: E402

PHASES = ("generate", "reward", "old_logp", "ref_logp", "update", "sync")  # ref_logp: KL runs


def _arm(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition(":")
    overrides = parse_overrides([f"--{kv}" for kv in rest.split(",") if kv]) if rest else {}
    return name, overrides


def measure(recipe: str, arms: list[tuple[str, dict]], steps: int, tokens: int | None,
            out: str, prepare: Callable[[str, object], None] | None = None) -> dict:
    """`prepare(name, policy)`, where given, alters each arm's built policy before its first
    push (a variant no recipe key expresses, e.g. `ignore_eos`)."""
    from contextlib import ExitStack

    from qarl.quant import SCHEMES
    from qarl.train.folder import open_run
    from qarl.train.sft import warm_start
    from qarl.train.trainer import rl_step

    common = {"run.output_dir": out, "run.resume": False, "log.progress": False,
              "eval.size": 8}
    if tokens is not None:
        common["rollout.max_new_tokens"] = tokens
    rows: dict[str, list[dict]] = {name: [] for name, _ in arms}
    with ExitStack() as stack:
        runs = []
        for name, overrides in arms:
            config = load_config(recipe, {**common, "run.name": name, **overrides})
            # the recipe's SFT warm start (cached), as `qarl train` starts from it
            _, policy, data = stack.enter_context(open_run(config, learner=warm_start(config)))
            if prepare is not None:
                prepare(name, policy)
            policy.sync.push()
            runs.append((name, config, policy, data))
        for step in range(steps):
            for name, config, policy, data in runs:
                began = time.perf_counter()
                metrics = rl_step(policy, data, config, step)
                if step > 0:  # step 0 builds packs and caches
                    rows[name].append({"step": time.perf_counter() - began,
                                       **{p: metrics.get(f"time/{p}", 0.0) for p in PHASES},
                                       "contract": metrics.get("contract/seconds", 0.0),
                                       "tokens": metrics["response/length_mean"]})
        kernel = SCHEMES["w8a8-int8"].kernel_path(
            runs[0][2].learner.model.model.embed_tokens.weight.device, None)
        backward = {name: policy.learner.passes.precision.quant_backward or "none"
                    for name, _, policy, _ in runs}
    means = {name: {k: round(sum(r[k] for r in rs) / len(rs), 3) for k in rs[0]}
             for name, rs in rows.items()}
    first = means[arms[0][0]]["step"]
    for m in means.values():
        m["ratio"] = round(first / m["step"], 3)  # > 1: faster than the first arm
    for name, m in means.items():
        m["quant_backward"] = backward[name]
    return {"arms": means, "int8_gemm": kernel}


def ignore_eos(name: str, policy) -> None:
    """A `measure` prepare hook: the sampler and the learner's decode-path replays (its own
    and the KL reference's, which must stop rows where the sampler did) end no row at an EOS
    id."""
    policy.engine.eos_token_ids = ()
    scorers = [policy.learner.passes.replayer]
    if policy.reference is not None:
        scorers.append(policy.reference.scorer)
    for scorer in scorers:
        if hasattr(scorer, "eos_token_ids"):
            scorer.eos_token_ids = ()


def in_processes(args: argparse.Namespace, arms: list[str]) -> dict:
    """`--rounds R`: every arm in a process of its own (this script with that one `--arm`),
    R rounds, the arms' order reversed every other round; each round's figures, each round's
    step ratios against the first arm, and the means over the rounds (`ratio`: the mean of
    the rounds' ratios)."""
    options = ["--recipe", args.recipe, "--steps", str(args.steps)]
    options += ["--tokens", str(args.tokens)] if args.tokens is not None else []
    options += ["--ignore-eos"] if args.ignore_eos else []
    rounds = []
    for r in range(args.rounds):
        row = {}
        for text in (arms if r % 2 == 0 else arms[::-1]):
            done = subprocess.run([sys.executable, os.path.abspath(__file__), *options,
                                   "--arm", text], capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"arm {text!r} failed (exit {done.returncode}):\n"
                                 f"{done.stderr[-4000:]}")
            one = json.loads(done.stdout)
            (name, figures), = one["arms"].items()
            row[name] = {**figures, "peak_rss_gb": one["peak_rss_gb"],
                         "loadavg_before": one["loadavg_before"]}
        rounds.append(row)
    names = [_arm(text)[0] for text in arms]
    for row in rounds:
        for name in names:
            row[name]["ratio"] = round(row[names[0]]["step"] / row[name]["step"], 3)
    keys = [k for k, v in rounds[0][names[0]].items() if isinstance(v, float)]
    means = {name: {k: round(sum(row[name][k] for row in rounds) / len(rounds), 3) for k in keys}
             for name in names}
    for name in names:
        means[name]["quant_backward"] = rounds[0][name]["quant_backward"]
    return {"arms": means, "rounds": rounds,
            "unit": "seconds per step (mean of steps 2..N), one process per arm and round"}


def write_results(result: dict, section: str = "step-time") -> None:
    """`--results`: the arms' mean seconds per step and per phase into docs/results.md (the
    page's section `section`), with the first arm's step against the second's as the glance."""
    from results_page import this_command, write_section

    arms = result["arms"]
    rss = all("peak_rss_gb" in m for m in arms.values())  # --rounds: each arm's own process
    first = next(iter(arms))
    head = ["arm", "s/step", *PHASES, f"speed vs `{first}`", *(["peak RSS"] if rss else []),
            "backward on"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in arms.items():
        cells = [f"`{name}`", f"{m['step']:.2f}", *(f"{m[p]:.2f}" for p in PHASES),
                 f"{m['ratio']:.2f}x", *([f"{m['peak_rss_gb']:.2f} GiB"] if rss else []),
                 m["quant_backward"]]
        lines.append("| " + " | ".join(cells) + " |")
    notes = (f"Recipe `{result['recipe']}`, the arms' overrides on the command line; seconds "
             "per step and per phase, the mean of steps 2..N (step 1 a warm-up); speed: the "
             "first arm's s/step over the arm's (> 1: faster); backward on: what the quantized "
             "layers' backward multiplies (train.quant_backward).")
    if rss:
        notes += (f" {len(result['rounds'])} rounds of one process per arm, the order reversed "
                  "every other round; means over the rounds.")
    glance = None
    if len(arms) > 1:
        second = list(arms)[1]
        a, b = arms[first]["step"], arms[second]["step"]
        glance = (f"RL step, `{first}` vs `{second}` ({result['recipe']} recipe)",
                  f"{a / b:.2f}x the time ({a:.2f} s vs {b:.2f} s)")
    title = "Seconds per RL step" + ("" if section == "step-time" else f" ({section})")
    write_section(section, title, this_command(), "\n".join(lines), notes=notes, glance=glance)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="default")
    parser.add_argument("--arm", action="append", default=None,
                        help="NAME:KEY=VALUE,... (default: w8a8 and none)")
    parser.add_argument("--steps", type=int, default=4, help="steps per arm, the first a warm-up")
    parser.add_argument("--tokens", type=int, default=None, help="rollout.max_new_tokens")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="every response runs to rollout.max_new_tokens (equal work per step)")
    parser.add_argument("--rounds", type=int, default=0,
                        help="R > 0: each arm in a process of its own, R rounds, the order "
                             "reversed every other round")
    parser.add_argument("--results", action="store_true",
                        help="write the arms' means into docs/results.md (section step-time)")
    parser.add_argument("--section", default="step-time",
                        help="the results page's section to write (e.g. kl-cost for a KL arm)")
    args = parser.parse_args()
    texts = args.arm or ["w8a8:", "none:quant.scheme=none"]
    if args.rounds > 0:
        result = in_processes(args, texts)
        result.update(recipe=args.recipe, steps=args.steps, tokens=args.tokens,
                      ignore_eos=args.ignore_eos, machine=machine())
        print(json.dumps(result, indent=1))
        if args.results:
            write_results(result, args.section)
        return
    arms = [_arm(text) for text in texts]
    tune_allocator()  # as qarl train does (QARL_MALLOC=default measures glibc's own)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as out:
        result = measure(args.recipe, arms, args.steps, args.tokens, out,
                         prepare=ignore_eos if args.ignore_eos else None)
    result.update(recipe=args.recipe, steps=args.steps, tokens=args.tokens,
                  ignore_eos=args.ignore_eos, machine=machine(),
                  unit="seconds per step (mean of steps 2..N)",
                  peak_rss_gb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
                  loadavg_before=load_before, loadavg_after=os.getloadavg())
    print(json.dumps(result, indent=1))
    if args.results:
        write_results(result, args.section)


if __name__ == "__main__":
    main()
