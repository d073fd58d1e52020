"""Delta weight sync: bytes and seconds per push, whole vs delta, per format, on the
in-process engine and on Ray rollout workers; and the arithmetic for larger models from the
measured change fractions. Prints one JSON object; `--results` also writes the tables into
docs/results.md (section `sync-delta`).

    nice -n 19 .venv/bin/python benchmarks/sync_delta.py                  # tiny and default
    nice -n 19 .venv/bin/python benchmarks/sync_delta.py --results
    nice -n 19 .venv/bin/python benchmarks/sync_delta.py --recipes tiny --steps 3 --workers 0

Per recipe and format, the recipe's run is built (its warm start, its in-process engine with
whole pushes) and takes `--steps` RL steps (`rl_step`: rollouts, rewards, the update). After
each step, whose own push quantized the learner once, the same new version goes to four more
engines, each timed on its own (`sync/seconds`: export of the cached codes, encoding, the
install; the digest check excluded):
- `local whole`: an in-process engine given the whole state (`quant.sync_delta = false`);
- `local delta`: an in-process engine given deltas (`quant.sync_delta = true`);
- `ray delta`: `--workers` Ray rollout workers given deltas (the default with Ray workers);
- `ray whole`: the same workers given the same version again whole, right after (each
  worker copies the codes it would patch, as at any whole push with deltas on).
The delta syncs check their engines' digests after every push (the contract's per-sync
check), so every figure is of an engine that holds the learner's bits.
Change fractions per step, from the learner's consecutive versions: codes (bytes: a packed
int4 byte is two codes), scales (elements), and the other tensors (elements), which travel
whole.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from qarl.config import load_config  # noqa: E402
from qarl.quant import QWeight, export_state  # noqa: E402
from qarl.quant.delta import encode_state, encoded_bytes  # noqa: E402
from qarl.train.folder import open_run  # noqa: E402
from qarl.train.policy import build_engine  # noqa: E402
from qarl.train.sft import warm_start  # noqa: E402
from qarl.train.sync import WeightSync, state_bytes  # noqa: E402
from qarl.train.trainer import rl_step  # noqa: E402

MB = 2**20
# Larger models for the arithmetic, from their published shapes: (layers, the [N, K] of each
# block's linears, other params). Qwen2.5-0.5B: 24 layers, hidden 896, MLP 4864, 14 query /
# 2 key-value heads of 64, tied 151936-token embedding. Llama-3.1-8B: 32 layers, hidden 4096,
# MLP 14336, 32 / 8 heads of 128, 128256-token embedding and a separate lm_head. Norms
# counted; biases ignored.
MODELS = {
    "Qwen2.5-0.5B": (24, [(896, 896), (128, 896), (128, 896), (896, 896), (4864, 896),
                          (4864, 896), (896, 4864)], 151936 * 896 + 896 * (2 * 24 + 1)),
    "Llama-3.1-8B": (32, [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096),
                          (14336, 4096), (14336, 4096), (4096, 14336)],
                     2 * 128256 * 4096 + 4096 * (2 * 32 + 1)),
}
CODE_BITS = {"w8a8-int8": 8, "w4a16-int4": 4}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def fractions(old: dict, new: dict) -> dict[str, float]:
    """Changed fractions between two exported states: codes (bytes), scales (elements), the
    other tensors (elements), and how often each encoding wins for the codes."""
    held = {k: v for k, v in old.items() if isinstance(v, QWeight)}
    delta = encode_state(held, new, 0, 1)
    codes = sum(v.codes.numel() for v in new.values() if isinstance(v, QWeight))
    scales = sum(v.scales.numel() for v in new.values() if isinstance(v, QWeight))
    plain = [(k, v) for k, v in new.items() if not isinstance(v, QWeight)]
    moved = sum(int((_bits(old[k]) != _bits(v)).sum()) for k, v in plain)
    wins: dict[str, int] = {}
    for d in delta.qweights.values():
        if "codes" in d.parts:
            wins[d.parts["codes"].encoding] = wins.get(d.parts["codes"].encoding, 0) + 1
    return {"codes": delta.changed("codes") / codes, "scales": delta.changed("scales") / scales,
            "other": moved / max(1, sum(v.numel() for _, v in plain)),
            "codes_encodings": wins}


def measure(recipe: str, scheme: str, steps: int, workers: int, output_dir: str) -> dict:
    config = load_config(recipe, {"run.output_dir": output_dir, "run.name": f"{recipe}-{scheme}",
                                  "quant.scheme": scheme, "quant.sync_delta": False,
                                  "log.progress": False})
    with open_run(config, learner=warm_start(config)) as (_, policy, data):
        learner = policy.learner.model
        policy.sync.push()
        syncs = {"local whole": WeightSync(learner, build_engine(config), check=False),
                 "local delta": WeightSync(learner, build_engine(config), delta=True)}
        engines = None
        if workers:
            from qarl.parallel import RayEngines, connect

            connect(None)
            engines = RayEngines(partial(build_engine, config), workers)
            syncs["ray delta"] = WeightSync(learner, engines, delta=True)
        for sync in syncs.values():
            sync.push()  # the first push: whole, untimed
        state, rows = export_state(learner), []
        state = {k: v if isinstance(v, QWeight) else v.clone() for k, v in state.items()}
        try:
            for step in range(steps):
                rl_step(policy, data, config, step)
                new = export_state(learner)  # the step's own push quantized it: cached
                row = {"change": fractions(state, new), "whole_mb": state_bytes(new) / MB}
                for name, sync in syncs.items():
                    m = sync.push()
                    row[name] = {"s": m["sync/seconds"], "mb": m["sync/megabytes"],
                                 "delta": m["sync/delta"]}
                if engines is not None:
                    began = time.perf_counter()
                    engines.load_versioned(export_state(learner), syncs["ray delta"].version)
                    row["ray whole"] = {"s": time.perf_counter() - began,
                                        "mb": row["whole_mb"], "delta": 0.0}
                rows.append(row)
                state = {k: v if isinstance(v, QWeight) else v.clone() for k, v in new.items()}
        finally:
            if engines is not None:
                engines.close()
    return summarize(recipe, scheme, state, rows)


def summarize(recipe: str, scheme: str, state: dict, rows: list[dict]) -> dict:
    qweights = [v for v in state.values() if isinstance(v, QWeight)]
    arms = [k for k in rows[0] if k not in ("change", "whole_mb")]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "recipe": recipe, "scheme": scheme, "steps": len(rows),
        "linear_params": sum(q.shape[0] * q.shape[1] for q in qweights),
        "other_params": sum(v.numel() for v in state.values() if not isinstance(v, QWeight)),
        "whole_mb": rows[-1]["whole_mb"],  # (of the learner's state: `state` holds copies)
        "codes_mb": sum(q.codes.numel() for q in qweights) / MB,
        "scales_mb": sum(q.scales.numel() * q.scales.element_size() for q in qweights) / MB,
        "codes_changed": [r["change"]["codes"] for r in rows],
        "scales_changed": [r["change"]["scales"] for r in rows],
        "other_changed": [r["change"]["other"] for r in rows],
        "codes_encodings": [r["change"]["codes_encodings"] for r in rows],
        "arms": {a: {"s_mean": mean([r[a]["s"] for r in rows]),
                     "mb_mean": mean([r[a]["mb"] for r in rows]),
                     "deltas": int(sum(r[a]["delta"] for r in rows)),
                     "mb_per_delta": (mean([r[a]["mb"] for r in rows if r[a]["delta"]])
                                      if any(r[a]["delta"] for r in rows) else None)}
                 for a in arms},
    }


def arithmetic(results: list[dict]) -> list[dict]:
    """Per larger model and format, from the default recipe's mean change fractions: the
    whole push and a delta, in GB. Codes: params x bits / 8 bytes; scales: int8 one fp32 per
    output channel, int4 one bf16 per 64 weights; a delta sends each in the smallest encoding
    of its measured fraction (`encoded_bytes`, over the whole model as one tensor); the other
    tensors whole, in the learner's fp32 (what qarl pushes)."""
    out = []
    for r in results:
        if r["recipe"] != "default" or r["scheme"] not in CODE_BITS:
            continue
        f_codes = sum(r["codes_changed"]) / len(r["codes_changed"])
        f_scales = sum(r["scales_changed"]) / len(r["scales_changed"])
        int4 = r["scheme"] == "w4a16-int4"
        for model, (layers, shapes, other) in MODELS.items():
            linear = layers * sum(n * k for n, k in shapes)
            codes = linear * CODE_BITS[r["scheme"]] // 8
            scale_n, width = (linear // 64, 2) if int4 else (layers * sum(n for n, _ in shapes), 4)
            code_sizes = encoded_bytes(codes, round(f_codes * codes), 1)
            scale_sizes = encoded_bytes(scale_n, round(f_scales * scale_n), width)
            best = min(code_sizes, key=code_sizes.get)
            delta = code_sizes[best] + min(scale_sizes.values())
            out.append({"model": model, "scheme": r["scheme"], "codes_changed": f_codes,
                        "scales_changed": f_scales, "encoding": best,
                        "whole_gb": (codes + scale_n * width + 4 * other) / 1e9,
                        "delta_gb": (delta + 4 * other) / 1e9,
                        "codes_scales_whole_gb": (codes + scale_n * width) / 1e9,
                        "codes_scales_delta_gb": delta / 1e9})
    return out


def _pct(xs: list[float]) -> str:
    return f"{100 * sum(xs) / len(xs):.2f}% ({100 * min(xs):.2f}-{100 * max(xs):.2f})"


def markdown(results: list[dict], sums: list[dict]) -> str:
    lines = ["| recipe | format | codes changed | scales changed | other changed | whole MB | "
             "codes + scales MB | delta MB (local / Ray) | deltas sent | local s whole / delta"
             " | Ray s whole / delta |", "|" + "---|" * 11]
    for r in results:
        a = r["arms"]
        delta = a["local delta"]["mb_per_delta"]
        ray = a.get("ray delta", {}).get("mb_per_delta")
        ray_s = (f"{a['ray whole']['s_mean']:.2f} / {a['ray delta']['s_mean']:.2f}"
                 if "ray delta" in a else "-")
        ray_n = f" / {a['ray delta']['deltas']}" if "ray delta" in a else ""
        lines.append(
            f"| {r['recipe']} | `{r['scheme']}` | {_pct(r['codes_changed'])} | "
            f"{_pct(r['scales_changed'])} | {_pct(r['other_changed'])} | {r['whole_mb']:.1f} | "
            f"{r['codes_mb'] + r['scales_mb']:.1f} | "
            f"{'-' if delta is None else f'{delta:.1f}'} / {'-' if ray is None else f'{ray:.1f}'}"
            f" | {a['local delta']['deltas']}{ray_n} of {r['steps']} | "
            f"{a['local whole']['s_mean']:.3f} / {a['local delta']['s_mean']:.3f} | {ray_s} |")
    lines += ["", "| model | format | codes / scales changed | codes encoding | whole push GB | "
              "delta GB | codes + scales: whole / delta GB |", "|" + "---|" * 7]
    for s in sums:
        lines.append(f"| {s['model']} | `{s['scheme']}` | {100 * s['codes_changed']:.2f}% / "
                     f"{100 * s['scales_changed']:.2f}% | "
                     f"{s['encoding']} | {s['whole_gb']:.2f} | {s['delta_gb']:.2f} | "
                     f"{s['codes_scales_whole_gb']:.2f} / {s['codes_scales_delta_gb']:.3f} |")
    return "\n".join(lines)


def notes(results: list[dict], workers: int) -> str:
    steps = ", ".join(f"{r['recipe']} {r['steps']}" for r in results[::2])
    return (f"RL steps per recipe and format: {steps}; each step's new weights pushed to every "
            f"engine ({workers} Ray rollout workers). Changed fractions: mean (min-max) over the "
            "steps, between consecutive versions; codes per byte (an int4 byte holds two codes), "
            "scales and the other tensors (embeddings, norms; they travel whole) per element. "
            "Delta MB: mean over the pushes that were deltas; a push is whole where a delta "
            "would not be smaller or the deltas since the last whole push would exceed its codes "
            "and scales (deltas sent counts the rest). Seconds: mean per push of the export "
            "(codes already quantized by the step), the encoding and the install, digest check "
            "excluded; the in-process whole push hands the engine the learner's tensors by "
            "reference. The machine is shared with other work while it runs: seconds are noisy, "
            "bytes are not. The model rows apply the default recipe's mean fractions to "
            "published shapes: codes = params x bits / 8 and scales (int8: fp32 per output "
            "channel; int4: bf16 per 64 weights), each in the smallest encoding of its fraction, "
            "+ the other tensors whole in fp32 as qarl pushes them; the fractions of a larger "
            "model at its own learning rate may differ.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", nargs="+", default=["tiny", "default"])
    parser.add_argument("--schemes", nargs="+", default=["w8a8-int8", "w4a16-int4"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="Ray rollout workers; 0: none")
    parser.add_argument("--results", action="store_true",
                        help="write the tables into docs/results.md (section sync-delta)")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as out:
        for recipe in args.recipes:
            for scheme in args.schemes:
                results.append(measure(recipe, scheme, args.steps, args.workers, out))
    sums = arithmetic(results)
    if args.results:
        from results_page import this_command, write_section

        write_section("sync-delta", "Weight sync: whole pushes and deltas of the codes",
                      this_command(), markdown(results, sums), notes=notes(results, args.workers))
    print(json.dumps({"results": results, "arithmetic": sums}, indent=1))


if __name__ == "__main__":
    main()
