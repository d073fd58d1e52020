"""Decode throughput of `LocalEngine` vs `transformers` `generate`, printed as one JSON object.

Both decode greedily, ignore EOS and produce exactly `--new-tokens` tokens per row from the
same weights and the same prompts. Decode time per step is
(time(generate N tokens) - time(generate 1 token)) / (N - 1), which removes the prefill and
the fixed per-call costs of both implementations the same way; each timing is the best of
`--repeats` interleaved runs after one warm-up call. Process CPU time per step is reported
too: with `--threads 1` it is the figure least disturbed by other jobs on a shared machine
(with more threads it includes OpenMP spin-waiting). The load average before and after the run
is recorded, since absolute times on a loaded machine mean little.

    .venv/bin/python benchmarks/engine_throughput.py --models qwen3-109m --batches 16 --dtypes fp32
    .venv/bin/python benchmarks/engine_throughput.py --results    # and write docs/results.md

`--results` also writes each model, dtype and batch's ms/step of both into docs/results.md
(section `engine-vs-hf`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from qarl.model import CausalLM, ModelConfig
from qarl.rollout import LocalEngine
from qarl.types import SamplingParams

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# The 109M Qwen3 config: random init, tied embeddings (108.5M parameters).
QWEN3_109M = dict(
    family="qwen3", vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_layers=8,
    num_heads=16, num_kv_heads=8, tie_word_embeddings=True, max_position_embeddings=4096,
)


def build(name: str, dtype: torch.dtype) -> CausalLM:
    if name == "qwen3-109m":
        torch.manual_seed(0)
        return CausalLM(ModelConfig(**QWEN3_109M)).to(dtype).eval()
    from qarl.model import load_model

    return load_model(name, dtype=dtype).eval()


def hf_twin(model: CausalLM):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf = model.config.to_hf()
    config = AutoConfig.for_model(hf.pop("model_type"), **hf)
    twin = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    twin.load_state_dict(model.state_dict(), strict=True)
    twin.generation_config.eos_token_id = None  # decode exactly max_new_tokens
    return twin.to(model.lm_head.weight.dtype).eval()


def decode_ms_per_step(
    generators: dict, new_tokens: int, repeats: int
) -> dict[str, tuple[float, float]]:
    """Per-step decode milliseconds (wall, process CPU) of each named `generate(n)`, timed
    interleaved.

    (t(N) - t(1)) / (N - 1) removes prefill and per-call overhead. The implementations take
    turns within each repeat and the best time of each is kept, so a burst of load from other
    processes on a shared machine hits all of them alike instead of one of them.
    """
    for generate in generators.values():
        generate(2)  # warm-up: allocator, kernels, lazy inits
    clocks = (time.perf_counter, time.process_time)
    best = {
        (name, n, c): float("inf") for name in generators for n in (1, new_tokens) for c in clocks
    }
    for _ in range(repeats):
        for n in (new_tokens, 1):
            for name, generate in generators.items():
                start = [clock() for clock in clocks]
                generate(n)
                for clock, began in zip(clocks, start):
                    best[name, n, clock] = min(best[name, n, clock], clock() - began)
    return {
        name: tuple(
            1000 * (best[name, new_tokens, c] - best[name, 1, c]) / (new_tokens - 1) for c in clocks
        )
        for name in generators
    }


def ours(model: CausalLM, prompts: list[list[int]], fuse_blocks: bool = True):
    engine = LocalEngine(model, eos_token_ids=(), pad_token_id=0, fuse_blocks=fuse_blocks)

    def generate(n: int):
        batch = engine.generate(prompts, SamplingParams(max_new_tokens=n, greedy=True), seed=0)
        assert batch.response_ids.shape[1] == n
    return generate


def theirs(model: CausalLM, prompts: list[list[int]]):
    twin = hf_twin(model)
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def generate(n: int):
        with torch.inference_mode():
            out = twin.generate(
                input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                pad_token_id=0,
            )
        assert out.shape[1] == ids.shape[1] + n
    return generate


def run_case(model, batch_size, args, with_hf) -> dict:
    generator = torch.Generator().manual_seed(batch_size)
    prompts = torch.randint(
        1, model.config.vocab_size, (batch_size, args.prompt_len), generator=generator
    ).tolist()
    generators = {"qarl": ours(model, prompts)}
    if args.unfused:
        generators["qarl_unfused"] = ours(model, prompts, fuse_blocks=False)
    if with_hf:
        generators["hf"] = theirs(model, prompts)
    ms = decode_ms_per_step(generators, args.new_tokens, args.repeats)
    case = {"batch": batch_size}
    for name, (step_ms, cpu_ms) in ms.items():
        case[f"{name}_ms_per_step"] = round(step_ms, 2)
        case[f"{name}_cpu_ms_per_step"] = round(cpu_ms, 2)
        case[f"{name}_tokens_per_s"] = round(1000 * batch_size / step_ms, 1)
    if with_hf:
        for name in ms.keys() - {"hf"}:
            suffix = name.removeprefix("qarl")
            case[f"speedup{suffix}"] = round(ms["hf"][0] / ms[name][0], 2)
            case[f"cpu_speedup{suffix}"] = round(ms["hf"][1] / ms[name][1], 2)
    return case


def write_results(report: dict) -> None:
    """`--results`: qarl's and transformers' ms/step per model, dtype and batch into
    docs/results.md, with the speed-up on SmolLM2 in fp32 (else the first model) as the
    glance."""
    from results_page import this_command, write_section

    head = ["model", "dtype", "batch", "qarl ms/step", "HF ms/step", "speed-up", "qarl tokens/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in report["results"]:
        if "skipped" in entry:
            lines.append(f"| {entry['model']} | {entry['dtype']} | skipped: "
                         f"{entry['skipped'].splitlines()[0].replace('|', '/')} |" + " |" * 4)
            continue
        for case in entry["cases"]:
            lines.append(f"| {entry['model']} | {entry['dtype']} | {case['batch']} | "
                         f"{case['qarl_ms_per_step']:.2f} | {case['hf_ms_per_step']:.2f} | "
                         f"{case['speedup']:.2f}x | {case['qarl_tokens_per_s']:.0f} |")
    notes = ("Greedy decode of the same weights and prompts, every row to the same length: "
             "`LocalEngine` (qarl) and transformers' `generate` (HF, sdpa attention); ms per "
             f"step = (t({report['new_tokens']} tokens) - t(1 token)) / "
             f"{report['new_tokens'] - 1}, the best of the interleaved repeats; speed-up: HF's "
             f"ms/step over qarl's; {report['threads']} torch threads. qwen3-109m: random "
             "weights of the 109M Qwen3 config.")
    measured = [e for e in report["results"] if "cases" in e]
    glance = None
    if measured:
        entry = next((e for e in measured if (e["model"], e["dtype"]) == ("smollm2-135m", "fp32")),
                     measured[0])
        glance = (f"qarl's engine vs transformers `generate`, decode ({entry['model']}, "
                  f"{entry['dtype']})",
                  " / ".join(f"{c['speedup']:.2f}x" for c in entry["cases"]) + " at batch "
                  + " / ".join(str(c["batch"]) for c in entry["cases"]))
    write_section("engine-vs-hf", "qarl's engine next to transformers", this_command(),
                  "\n".join(lines), notes=notes, glance=glance)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="tiny,qwen3-109m,smollm2-135m",
                        help="comma-separated: zoo names, local paths, or qwen3-109m")
    parser.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    parser.add_argument("--dtypes", default="fp32,bf16",
                        help=f"comma-separated, of {sorted(DTYPES)}")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode steps timed per call")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2, help="timed calls per figure (best kept)")
    parser.add_argument("--no-hf", action="store_true", help="time only qarl's engine")
    parser.add_argument("--unfused", action="store_true",
                        help="also time qarl with per-linear packing only (fuse_blocks=False)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads for both implementations (default: torch's)")
    parser.add_argument("--results", action="store_true",
                        help="write the figures into docs/results.md (section engine-vs-hf)")
    args = parser.parse_args(argv)
    if args.results and args.no_hf:
        parser.error("--results writes qarl's engine next to transformers': drop --no-hf")
    unknown = [d for d in args.dtypes.split(",") if d not in DTYPES]
    if unknown:
        parser.error(f"unknown dtypes {unknown}; choose from {sorted(DTYPES)}")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be >= 2 to time decode steps, got {args.new_tokens}")

    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    report = {
        "benchmark": "engine_throughput", "torch": torch.__version__,
        "threads": torch.get_num_threads(), "machine": platform.machine(),
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "new_tokens": args.new_tokens, "prompt_len": args.prompt_len, "results": [],
    }
    for name in args.models.split(","):
        for dtype_name in args.dtypes.split(","):
            entry = {"model": name, "dtype": dtype_name}
            try:
                model = build(name, DTYPES[dtype_name])
            except Exception as error:  # a model that cannot load is reported, not fatal
                entry["skipped"] = f"{type(error).__name__}: {error}"
                report["results"].append(entry)
                continue
            entry["params_m"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 1)
            entry["cases"] = [
                run_case(model, int(b), args, not args.no_hf) for b in args.batches.split(",")
            ]
            report["results"].append(entry)
    report["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=1))
    if args.results:
        write_results(report)
    return report


if __name__ == "__main__":
    main()
