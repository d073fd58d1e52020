"""docs/results.md sections from a gpu_check.json (benchmarks/gpu_check.sh's, fetched from the
machine it ran on), written with the run's machine class and date, not this machine's:

    .venv/bin/python benchmarks/gpu_report.py results gpu_check.json

Section `gpu-check` always: each part's status and seconds, the carried wheels' size. On
CUDA also `gpu-parity` (the learner-vs-sampler matrix), `gpu-train` (each RL step's mismatch
and phases) and `gpu-step-time` (seconds per RL step of each quantized scheme against bf16,
with peak GPU memory), each with a glance line.
"""

from __future__ import annotations

import re

from parity_table import glance as parity_glance
from parity_table import markdown as parity_markdown
from results_page import write_section

PHASES = ("generate", "reward", "old_logp", "update", "sync")
SHAPE_NOTE = ("Models built in code, no weights downloaded: `tiny` (the zoo's), and random-init "
              "models of SmolLM2-135M's and Qwen2.5-0.5B's shapes with tiny's tokenizer "
              "(benchmarks/gpu_parts.py): every response runs to rollout.max_new_tokens, and "
              "benchmarks/coin_reward.py scores them so that every step updates.")


def machine(report: dict) -> str:
    """The machine class of the run, from its probe: the GPU, or the CPU dry run."""
    probe = report["probe"]
    torch = f"torch {probe.get('torch', '?')}, Python {probe.get('python', '?')}"
    if "gpu" in probe:
        return f"CUDA: {probe['gpu']['name']}; {torch}"
    return f"CPU dry run ({probe.get('wheels_tag', '?')}); {torch}"


def command(report: dict) -> str:
    """The check's command line, less where its JSON went."""
    args = re.sub(r"\s*--json\s+\S+", "", report.get("args", ""))
    return " ".join(["bash benchmarks/gpu_check.sh", args]).strip()


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def figures(report: dict, part: str) -> dict:
    found = report["parts"].get(part, {}).get("figures")
    return found if isinstance(found, dict) else {}


def gib(value) -> str:
    return "-" if value is None else f"{value:.2f} GiB"


def check_section(report: dict, where: dict) -> None:
    rows = [[f"`{name}`", p["status"], "-" if p["seconds"] is None else f"{p['seconds']:.1f}",
             "-" if p["limit_s"] is None else str(p["limit_s"])]
            for name, p in report["parts"].items()]
    wheels = report["wheels"]
    peak = report["peak_gpu_allocated_gib"]
    notes = (f"Status {report['status']}, {report['wall_s']} s in all (budget "
             f"{report['budget_s']} s); carried wheels: {len(wheels['files'])} files, "
             f"{wheels['total_mib']:.1f} MiB (benchmarks/gpu_wheels.sh)"
             + ("" if peak is None else f"; peak GPU memory allocated {gib(peak)}")
             + ". Each part runs under its own time limit (s), cut to what the budget leaves.")
    write_section("gpu-check", "GPU check", command(report),
                  table(["part", "status", "seconds", "limit"], rows), notes=notes, **where)


def parity_section(report: dict, where: dict) -> None:
    found = figures(report, "parity")
    if not found.get("rows"):
        return
    what, reading = parity_glance(found["rows"])
    errors = "".join(f" Scheme `{s}` failed: {e.strip().splitlines()[-1]}."
                     for s, e in found.get("errors", {}).items())
    notes = (f"`qarl parity --model tiny --device cuda` ({found['prompts']} prompts, "
             f"{found['max_new_tokens']} new tokens): mean |Δlogp| (exact: bit for bit), as "
             f"in the CPU section above.{errors}")
    write_section("gpu-parity", "Learner vs sampler logprobs on CUDA", command(report),
                  parity_markdown(found["rows"]), notes=notes,
                  glance=(f"{what} on CUDA", reading), **where)


def train_section(report: dict, where: dict) -> None:
    rows = []
    for align in ("kernel", "fake"):
        for step in figures(report, f"train_{align}").get("steps", []):
            rows.append([f"`{align}`", str(step["step"]),
                         f"{step.get('mismatch/abs_diff_max', float('nan')):.2e}",
                         f"{step.get('mismatch/abs_diff_mean', float('nan')):.2e}",
                         *(f"{step.get(f'time/{p}', 0.0):.2f}" for p in PHASES)])
    if not rows:
        return
    model = figures(report, "train_kernel").get("overrides", {}).get("model.name", "?")
    notes = (f"The default recipe on `{model.rsplit('/', 1)[-1]}`, train.device = cuda: each "
             f"step's learner-vs-sampler |Δlogp| (max, mean) and seconds per phase. {SHAPE_NOTE}")
    write_section("gpu-train", "RL steps on CUDA", command(report),
                  table(["align", "step", "max |Δ|", "mean |Δ|", *PHASES], rows), notes=notes,
                  **where)


def step_time_section(report: dict, where: dict) -> None:
    blocks, glance = [], None
    for part in [name for name in report["parts"] if name.startswith("step_time_")]:
        found = figures(report, part)
        rows = [[f"`{arm}`", f"{m['step']:.2f}", *(f"{m[p]:.2f}" for p in PHASES),
                 "-" if m.get("speed_vs_bf16") is None else f"{m['speed_vs_bf16']:.2f}x",
                 gib(m.get("peak_gpu_allocated_gib"))]
                for arm, m in found.get("arms", {}).items()]
        if not rows:
            continue
        model = found["model"].rsplit("/", 1)[-1]
        errors = "; ".join(f"`{a}` failed: {e.strip().splitlines()[-1]}"
                           for a, e in found.get("errors", {}).items())
        blocks.append(f"**{model}**\n\n" + table(
            ["arm", "s/step", *PHASES, "speed vs `bf16`", "peak GPU"], rows)
            + (f"\n\n{errors}" if errors else ""))
        arms = found["arms"]
        if "bf16" in arms and "w8a8-int8" in arms:
            glance = (f"RL step on CUDA, `w8a8-int8` vs `bf16` ({model})",
                      f"{arms['w8a8-int8']['step'] / arms['bf16']['step']:.2f}x the time "
                      f"({arms['w8a8-int8']['step']:.2f} s vs {arms['bf16']['step']:.2f} s)")
    if not blocks:
        return
    notes = ("The default recipe, train.device = cuda, one arm at a time in one process; "
             "seconds per step and phase, the mean of steps 2..N (step 1 a warm-up); `bf16`: "
             "scheme none with bf16 masters and lr 0 (rollouts and learner in bf16); the "
             "quantized arms: fp32 masters, kernel alignment, the gradient pass in bf16 "
             f"(train.compute_dtype auto); peak GPU: torch's allocated peak. {SHAPE_NOTE}")
    write_section("gpu-step-time", "Seconds per RL step on CUDA", command(report),
                  "\n\n".join(blocks), notes=notes, glance=glance, **where)


def write_results(report: dict) -> None:
    where = {"machine": machine(report), "date": report["date"]}
    check_section(report, where)
    if "gpu" in report["probe"]:
        parity_section(report, where)
        train_section(report, where)
        step_time_section(report, where)
