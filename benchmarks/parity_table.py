"""The learner's logprobs against the sampler's, per scheme and alignment, from `qarl parity
--json`, as one JSON object; `--results` also writes the mean |Δlogp| of each scheme x
alignment into docs/results.md (section `parity`).

    .venv/bin/python benchmarks/parity_table.py                   # qarl parity --model tiny
    .venv/bin/python benchmarks/parity_table.py --results         # and write docs/results.md
    .venv/bin/python benchmarks/parity_table.py --results -- --model smollm2-135m --prompts 8

The arguments after `--` are `qarl parity`'s (default: `--model tiny`); `--json` is added.
The rows come from a `qarl parity` child process, as a user runs it; its progress lines go to
stderr as they come.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DEFAULT_PARITY_ARGS = ["--model", "tiny"]
DECODE_REPLAY = "decode-replay"  # the path old_logp takes in training (qarl.cli.parity_matrix)
NOTES = ("Mean |Δlogp| over the response tokens between the learner's logprobs and the "
         "sampler's (`rollout_logp`), one sampled batch per scheme; 'exact': equal bit for bit. "
         "decode-replay: the learner replays the engine's decode path (old_logp in training); "
         "full-sequence: one teacher-forced forward (the gradient's path). Scheme `none` (full "
         "precision on both sides) is measured once: the floor. docs/alignment.md explains the "
         "alignments.")


def parity_rows(parity_args: list[str]) -> list[dict]:
    """The rows of `qarl parity PARITY_ARGS --json`, run as a child process."""
    qarl = Path(sys.executable).with_name("qarl")
    command = [str(qarl), "parity", *parity_args, "--json"]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"`{' '.join(command)}` failed (exit {done.returncode}); its errors "
                         "are above")
    return json.loads(done.stdout)


def dlogp(value: float) -> str:
    if value == 0:
        return "0"
    return f"{value:.2e}" if abs(value) < 1e-2 else f"{value:.4f}"


def path_label(row: dict) -> str:
    """The row's path, with what else tells rows of one scheme and alignment apart."""
    label = row["path"]
    if row.get("routing_replay") is not None:
        label += ", routing replay" if row["routing_replay"] else ", own routing"
    if row.get("lora_rank"):
        label += f", LoRA r{row['lora_rank']}"
    if row.get("engine", "local") != "local":
        label += f", {row['engine']}"
    return label


def markdown(rows: list[dict]) -> str:
    """One line per scheme and path, one column per alignment: mean |Δlogp| (exact)."""
    aligns = list(dict.fromkeys(r["align"] for r in rows))
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for r in rows:
        shown = dlogp(r["mean_abs_dlogp"]) + (" (exact)" if r["bit_exact"] else "")
        cells.setdefault((r["scheme"], path_label(r)), {})[r["align"]] = shown
    head = ["scheme", "path", *(f"`{a}`" for a in aligns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (scheme, path), by_align in cells.items():
        lines.append(f"| `{scheme}` | {path} | "
                     + " | ".join(by_align.get(a, "-") for a in aligns) + " |")
    return "\n".join(lines)


def glance(rows: list[dict]) -> tuple[str, str]:
    """How many schemes' `kernel` decode replays are exact, else the range of mean |Δlogp|."""
    kernel = [r for r in rows if r["align"] == "kernel" and r["path"] == DECODE_REPLAY]
    if kernel:
        exact = sum(r["bit_exact"] for r in kernel)
        return ("learner vs sampler logprobs, `kernel` alignment",
                f"old_logp = rollout_logp bit for bit in {exact} of {len(kernel)} schemes")
    means = [r["mean_abs_dlogp"] for r in rows]
    return "learner vs sampler logprobs", f"mean |Δlogp| {dlogp(min(means))}-{dlogp(max(means))}"


def main() -> None:
    argv = sys.argv[1:]
    ours, parity_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, DEFAULT_PARITY_ARGS)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     usage="%(prog)s [--results] [-- QARL_PARITY_ARGS ...]")
    parser.add_argument("--results", action="store_true",
                        help="write the table into docs/results.md (section parity)")
    args = parser.parse_args(ours)
    rows = parity_rows(parity_args)
    if args.results:
        from results_page import this_command, write_section

        write_section("parity", "Learner vs sampler logprobs", this_command(), markdown(rows),
                      notes=f"`qarl parity {' '.join(parity_args)}`. {NOTES}",
                      glance=glance(rows))
    print(json.dumps({"parity_args": parity_args, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
