"""Seconds per RL step of TRL's GRPOTrainer next to qarl on the same model, prompts, reward and
batch, as one JSON object. Needs the TRL environment (`make bench-trl` creates .venv-trl and
runs this with its defaults):

    make bench-trl                                                   # --steps 4
    .venv-trl/bin/python benchmarks/trl_side_by_side.py --steps 4
    .venv-trl/bin/python benchmarks/trl_side_by_side.py --steps 2 --tokens 8   # smoke run
    .venv-trl/bin/python benchmarks/trl_side_by_side.py --arms trl-fp32,qarl

Arms: `qarl` (the recipe as it is: W8A8 rollouts, kernel alignment, TBPO), `qarl-none`
(`quant.scheme=none`), both through `measure()` of benchmarks/step_time.py; `trl-fp32`
(GRPOTrainer, bf16=False, no gradient checkpointing) and `trl-defaults` (GRPOConfig's own
bf16=True autocast and gradient_checkpointing=True). What the recipe fixes, TRL gets too: the
zoo model's Hugging Face folder (config.json, model.safetensors, tokenizer; prepared once under
$QARL_HOME, never downloaded), the task's prompts of steps 0..N-1 in qarl's order as a
conversational `datasets.Dataset`, the task's reward, rollout.batch_size responses per step
(batch_size / group_size prompts x group_size: generation_batch_size and num_generations), one
optimizer step per batch over train.micro_batch_size micro-batches
(per_device_train_batch_size, gradient_accumulation_steps), max_completion_length =
rollout.max_new_tokens (`--tokens` sets both), the temperature / top-p / top-k, lr (constant),
AdamW betas, weight decay, grad clip and seed. TRL keeps its own loss (dapo, beta 0: no
reference model) and its own generation (transformers' `generate`).

Each arm runs in its own process, one after another, so `peak_rss_gb` is that arm's alone (no
two arms hold memory at once); the machine's drift between arms is therefore in the
ratios, and each arm's load average is recorded. Step 1 of each arm is a warm-up left out of
the means. TRL's phases come from timing its own methods: `generate` (`_generate`: tokenize,
`generate`, decode), `reward` (`_calculate_rewards`), `prepare` (the rest of
`_generate_and_score_completions`: padding, advantages) and `update` (the rest of the optimizer
step: forward/backward of the micro-batches, clip, AdamW). Response lengths count the
final EOS on both sides. `qarl_speedup` is each arm's mean step over qarl's (> 1: qarl faster).

Time: on a CPU without AVX512-BF16 / AMX `trl-defaults` is by far the slowest arm (its bf16
autocast is emulated there); leave it out with `--arms` for a quick comparison. `--results`
also writes the arms into docs/results.md (section `trl`):
`make bench-trl BENCH_ARGS=--results`.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

ARMS = ("qarl", "trl-fp32", "trl-defaults", "qarl-none")
QARL_ARMS = {"qarl": {}, "qarl-none": {"quant.scheme": "none"}}
# GRPOConfig overrides per TRL arm; an empty dict keeps TRL's defaults
TRL_ARMS = {"trl-fp32": {"bf16": False, "gradient_checkpointing": False}, "trl-defaults": {}}
VERSIONS = ("trl", "transformers", "torch", "accelerate", "datasets")


def _config(recipe: str, tokens: int | None):
    from qarl.config import load_config

    overrides = {"run.resume": False} if tokens is None else {
        "run.resume": False, "rollout.max_new_tokens": tokens}
    return load_config(recipe, overrides)


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _peak_rss_gb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)  # KiB -> GiB


# ---- qarl arms: benchmarks/step_time.py's measure(), one arm per process ----------------


def qarl_arm(name: str, recipe: str, steps: int, tokens: int | None) -> dict:
    from step_time import PHASES, measure  # benchmarks/ is sys.path[0] when run

    from qarl.native.memory import huge_pages, tune_allocator

    allocator = tune_allocator()  # as qarl train (and step_time.py) do
    with tempfile.TemporaryDirectory() as out:
        result = measure(recipe, [(name, QARL_ARMS[name])], steps, tokens, out)
    row = result["arms"][name]
    return {"step": row["step"], "phases": {p: row[p] for p in PHASES},
            "response_length_mean": row["tokens"], "allocator": allocator,
            "huge_pages": huge_pages(),
            "settings": {"overrides": QARL_ARMS[name], "int8_gemm": result["int8_gemm"]}}


# ---- TRL arms ----------------------------------------------------------------------------


def trl_dataset(config, steps: int):
    """The prompts qarl's steps 0..steps-1 draw, in that order, as TRL's conversational rows
    (with the reward's fields as columns); TRL takes them in order (shuffle_dataset=False)."""
    from datasets import Dataset

    from qarl.train.phases import train_examples
    from qarl.train.data import build_task

    task = build_task(config)
    prompts_per_step = config.rollout.batch_size // config.rollout.group_size
    rows = []
    for step in range(steps):
        for ex in train_examples(task, config.run.seed, step, prompts_per_step):
            system = ex.system if ex.system is not None else config.task.system_prompt
            messages = [{"role": "user", "content": ex.prompt}]
            if system is not None:
                messages.insert(0, {"role": "system", "content": system})
            rows.append({"prompt": messages, **ex.reward_kwargs()})
    return task, Dataset.from_list(rows)


def trl_reward(task, fields: list[str]):
    """The task's reward, (prompt, completion, **fields) -> float | None, in TRL's signature:
    (prompts, completions, **columns) -> one reward per completion."""
    def reward(prompts, completions, **columns):
        return [task.reward(prompt[-1]["content"], completion[0]["content"],
                            **{k: columns[k][i] for k in fields})
                for i, (prompt, completion) in enumerate(zip(prompts, completions))]

    reward.__name__ = f"{task.name}_reward"  # TRL names its reward metrics after it
    return reward


def grpo_args(config, out: str, steps: int, overrides: dict):
    from trl import GRPOConfig

    rollout, train = config.rollout, config.train
    return GRPOConfig(
        output_dir=out, max_steps=steps, seed=config.run.seed, use_cpu=True,
        generation_batch_size=rollout.batch_size, num_generations=rollout.group_size,
        per_device_train_batch_size=train.micro_batch_size,
        gradient_accumulation_steps=rollout.batch_size // train.micro_batch_size,
        num_iterations=1, shuffle_dataset=False,
        max_completion_length=rollout.max_new_tokens, temperature=rollout.temperature,
        top_p=rollout.top_p, top_k=rollout.top_k,
        learning_rate=train.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=train.weight_decay, adam_beta1=train.betas[0], adam_beta2=train.betas[1],
        max_grad_norm=train.grad_clip, beta=0.0,
        report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, **overrides)


class PhaseClock:
    """Seconds spent in wrapped trainer methods during the current optimizer step."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, trainer, method: str, phase: str) -> None:
        inner = getattr(trainer, method, None)
        if inner is None:  # a private method: the pinned TRL has it, another may not
            raise AttributeError(f"GRPOTrainer has no {method}() in trl "
                                 f"{importlib.metadata.version('trl')}; this benchmark reads "
                                 "phase times from it (pin trl as the Makefile does)")

        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - began

        setattr(trainer, method, timed)  # an instance attribute: shadows the bound method


def step_timer(clock: PhaseClock, trainer, rows: list[dict]):
    """A TrainerCallback: each optimizer step's seconds by phase, step 1 left out."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.seconds.clear()
            self.began = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - self.began
            s = {p: clock.seconds.get(p, 0.0) for p in ("generate", "reward", "scored")}
            if state.global_step > 1:  # step 1: first allocations, first generate
                rows.append({"step": step, "generate": s["generate"], "reward": s["reward"],
                             "prepare": s["scored"] - s["generate"] - s["reward"],
                             "update": step - s["scored"],
                             "tokens": trainer._metrics["train"]["completions/mean_length"][-1]})

    return StepTimer()


def trl_arm(name: str, recipe: str, steps: int, tokens: int | None) -> dict:
    from trl import GRPOTrainer

    from qarl.model.zoo import resolve

    config = _config(recipe, tokens)
    task, dataset = trl_dataset(config, steps)
    fields = [c for c in dataset.column_names if c != "prompt"]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as out:
        args = grpo_args(config, out, steps, TRL_ARMS[name])
        trainer = GRPOTrainer(model=str(resolve(config.model.name)), args=args,
                              reward_funcs=trl_reward(task, fields), train_dataset=dataset)
        clock = PhaseClock()
        clock.wrap(trainer, "_generate", "generate")
        clock.wrap(trainer, "_calculate_rewards", "reward")
        clock.wrap(trainer, "_generate_and_score_completions", "scored")
        trainer.add_callback(step_timer(clock, trainer, rows))
        trainer.train()
    means = {k: round(sum(r[k] for r in rows) / len(rows), 3) for k in rows[0]}
    return {"step": means.pop("step"), "response_length_mean": means.pop("tokens"),
            "phases": means, "allocator": "glibc default (untouched)",
            "settings": {"overrides": TRL_ARMS[name], "bf16": args.bf16,
                         "gradient_checkpointing": args.gradient_checkpointing,
                         "mixed_precision": trainer.accelerator.mixed_precision,
                         "loss_type": args.loss_type, "model_dtype": str(trainer.model.dtype),
                         "per_device_train_batch_size": args.per_device_train_batch_size,
                         "gradient_accumulation_steps": args.gradient_accumulation_steps,
                         "generation_batch_size": args.generation_batch_size,
                         "num_generations": args.num_generations,
                         "max_completion_length": args.max_completion_length}}


# ---- the parent: one process per arm --------------------------------------------------------


def run_arm(name: str, args: argparse.Namespace) -> dict:
    """`name` in a fresh interpreter (this file with --run-arm); its JSON, or what failed."""
    command = [sys.executable, os.path.abspath(__file__), "--run-arm", name, "--recipe",
               args.recipe, "--steps", str(args.steps), "--threads", str(args.threads)]
    if args.tokens is not None:
        command += ["--tokens", str(args.tokens)]
    load_before, began = _loadavg(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    common = {"wall_s": round(time.perf_counter() - began, 1), "loadavg_before": load_before,
              "loadavg_after": _loadavg()}
    if done.returncode != 0:
        tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-15:]
        return {"failed": f"exit {done.returncode}", "stderr_tail": tail, **common}
    return {**json.loads(done.stdout.strip().splitlines()[-1]), **common}


def write_results(report: dict, section: str = "trl") -> None:
    """`--results`: each arm's s/step, phases and peak RSS into docs/results.md (the page's
    section `section`), with qarl's speed over TRL's fastest arm as the glance."""
    from results_page import this_command, write_section

    arms = report["arms"]
    phases = list(dict.fromkeys(p for r in arms.values() for p in r.get("phases", {})))
    head = ["arm", "s/step", *phases, "vs `qarl`", "response tokens", "peak RSS"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in arms.items():
        if "step" not in r:
            lines.append(f"| `{name}` | failed: {r['failed']} |" + " |" * (len(head) - 2))
            continue
        speedup = report["qarl_speedup"].get(name)
        cells = [f"`{name}`", f"{r['step']:.2f}",
                 *(f"{r['phases'][p]:.2f}" if p in r["phases"] else "-" for p in phases),
                 "-" if speedup is None else f"{speedup:.2f}x", f"{r['response_length_mean']:.1f}",
                 f"{r['peak_rss_gb']:.2f} GiB"]
        lines.append("| " + " | ".join(cells) + " |")
    batch = report["batch"]
    notes = (f"Recipe `{report['recipe']}` ({report['model']}): {batch['responses']} responses "
             f"of at most {report['tokens']} tokens per step, groups of {batch['group_size']}, "
             f"micro-batches of {batch['micro_batch_size']}. Seconds per step and per phase, the "
             "mean of steps 2..N, each arm in a process of its own, one after another. qarl's "
             "phases are its trainer's; TRL's are timed from its own methods (`prepare`: the rest "
             "of scoring, `update`: the rest of the optimizer step). vs `qarl`: the arm's s/step "
             "over qarl's (> 1: qarl faster). `qarl`: the recipe as it is; `qarl-none`: "
             "quant.scheme = none; `trl-fp32`: bf16 off, no gradient checkpointing; "
             "`trl-defaults`: GRPOConfig's own. Versions: "
             + ", ".join(f"{p} {v}" for p, v in report["versions"].items()) + ".")
    speedup = report["qarl_speedup"]
    trl = {name: speedup[name] for name in TRL_ARMS if name in speedup}
    glance = None
    if trl:
        fastest = min(trl, key=trl.get)
        glance = (f"qarl vs TRL's GRPOTrainer, {report['recipe']} recipe",
                  f"{trl[fastest]:.1f}x as fast as TRL's fastest arm (`{fastest}`)")
    title = "qarl next to TRL" + ("" if section == "trl" else f" ({section})")
    write_section(section, title, this_command(), "\n".join(lines), notes=notes, glance=glance)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="default")
    parser.add_argument("--steps", type=int, default=4, help="steps per arm, the first a warm-up")
    parser.add_argument("--tokens", type=int, default=None,
                        help="rollout.max_new_tokens and TRL's max_completion_length")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every arm")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {ARMS}")
    parser.add_argument("--results", action="store_true",
                        help="write the arms into docs/results.md (section trl)")
    parser.add_argument("--section", default="trl",
                        help="the results page's section to write (e.g. trl-avx2: one per "
                             "machine class)")
    parser.add_argument("--run-arm", choices=ARMS, help=argparse.SUPPRESS)  # a child's arm
    args = parser.parse_args()
    if args.steps < 2:
        parser.error(f"--steps {args.steps}: step 1 is a warm-up, so at least 2 are needed")
    arms = args.arms.split(",")
    if unknown := sorted(set(arms) - set(ARMS)):
        parser.error(f"unknown arms {unknown}; valid: {sorted(ARMS)}")
    if importlib.util.find_spec("trl") is None and any(a in TRL_ARMS for a in arms):
        parser.error(f"trl is not installed in {sys.prefix}; `make bench-trl` builds .venv-trl "
                     "(or pass --arms qarl,qarl-none)")
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # nothing is downloaded
    if args.run_arm in QARL_ARMS:
        import qarl  # noqa: F401  before torch, as in `qarl train`: huge pages (qarl/native/memory.py)

    import torch

    torch.set_num_threads(args.threads)
    if args.run_arm is not None:
        arm = qarl_arm if args.run_arm in QARL_ARMS else trl_arm
        result = arm(args.run_arm, args.recipe, args.steps, args.tokens)
        print(json.dumps({**result, "peak_rss_gb": _peak_rss_gb()}))
        return

    from qarl.model.zoo import resolve
    from qarl.native import machine

    config = _config(args.recipe, args.tokens)
    model_folder = resolve(config.model.name)  # prepared here, so no arm's time includes it
    load_before = _loadavg()
    results = {name: run_arm(name, args) for name in arms}
    qarl_step = results.get("qarl", {}).get("step")
    speedup = {name: round(r["step"] / qarl_step, 2) for name, r in results.items()
               if qarl_step and name != "qarl" and "step" in r}
    report = {
        "recipe": args.recipe, "model": config.model.name, "model_folder": str(model_folder),
        "steps": args.steps, "tokens": config.rollout.max_new_tokens,
        "batch": {"responses": config.rollout.batch_size, "group_size": config.rollout.group_size,
                  "micro_batch_size": config.train.micro_batch_size},
        "unit": "seconds per step (mean of steps 2..N)", "arms": results,
        "qarl_speedup": speedup, "machine": machine(),
        "versions": {p: importlib.metadata.version(p) for p in VERSIONS},
        "loadavg_before": load_before, "loadavg_after": _loadavg(),
    }
    print(json.dumps(report, indent=1))
    if args.results:
        write_results(report, args.section)


if __name__ == "__main__":
    main()
