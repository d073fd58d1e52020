"""Quantized linear kernels and quantized decode speed, printed as one JSON object.

Part 1 ("layers"): one linear layer per format at M = 1, 16, 256 rows and (K, N) from 1024 to
4096, timed against plain fp32 and bf16 `F.linear`, the batch-invariant fp32 linear and (where
it runs) qarl.native's packed fp32 GEMM, which is what the engine's fp32 decode uses.
Part 2 ("decode"): `qarl.rollout.LocalEngine` greedy decode ms/step per format (projections
quantized in kernel mode, lm_head left to the engine in fp32; with `--lm-head both` each
format also as "<format>+lm_head", lm_head quantized too) on the 109M Qwen3 config and on
smollm2-135m, batch 1 and 16; step time = (t(N tokens) - t(1 token)) / (N - 1), best of
`--repeats`, the formats' engines built side by side and their timed calls interleaved.
Part 3 ("blocks", not in the default `--parts`): one decode step's decoder blocks alone, 30
`qarl.native.DecodeBlock`s with synthetic weights of SmolLM2-135M's and the 109M config's
shapes, one token per sequence over 33 cached keys, for the formats whose projections are
native GEMMs (fp32 = the `none` format on fp32 weights): the engine's call without the lm_head,
sampling and the loop.
Part 4 ("int8", not in the default `--parts`): one W8A8 layer at the given shapes and rows
through qarl.native's int8 GEMM under each instruction set this CPU has (`native.S8_ISAS`:
AVX2 `vpmaddubsw`, AVX-VNNI, AVX-512 VNNI; the same bits on each), `torch._int_mm` (oneDNN,
activation quantization and scales included, as the format runs it) and fp32 `F.linear`.
Part 5 ("f32", not in the default `--parts`): qarl.native's fp32 GEMM (the engine's `none`
layers, lm_head and, through its chains, the int4 GEMM) under each instruction set this CPU
has (`native.F32_ISAS`: AVX2 4-row tiles, AVX-512 8-row tiles; the same bits on each) next to
fp32 `F.linear` (MKL).

Run it on a quiet machine: with other jobs running, the OpenMP threads make every GEMM wait on
the busiest core, which slows M>1 GEMMs many times over; the load average before and after is
recorded.

    .venv/bin/python benchmarks/quant_kernels.py                # layers and decode
    .venv/bin/python benchmarks/quant_kernels.py --parts layers --shapes 1024x4096
    .venv/bin/python benchmarks/quant_kernels.py --parts blocks --formats none,w8a8-int8,w4a16-int4
    .venv/bin/python benchmarks/quant_kernels.py --parts int8 --shapes 576x1536,1536x576 \
        --rows 1,16,32,256
    .venv/bin/python benchmarks/quant_kernels.py --parts f32 --shapes 576x1536,1536x576,576x49152 \
        --rows 1,4,32,256
    .venv/bin/python benchmarks/quant_kernels.py --parts decode --results   # into docs/results.md

`--results` (with the decode part) also writes the decode part's ms/step per format and batch
into docs/results.md (section `decode`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
import torch.nn.functional as F

from qarl import native
from qarl.quant import SCHEMES, batch_invariant_linear, quantize_model

QWEN3_109M = dict(  # same as benchmarks/engine_throughput.py (108.5M parameters)
    family="qwen3", vocab_size=8192, hidden_size=1024, intermediate_size=3072, num_layers=8,
    num_heads=16, num_kv_heads=8, tie_word_embeddings=True, max_position_embeddings=4096,
)


def best_ms(fn, budget_s: float = 1.0, max_repeats: int = 7) -> float:
    """Best wall time of fn() in ms: one warm-up, then as many repeats as fit `budget_s`."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    best = first
    for _ in range(max(1, min(max_repeats, int(budget_s / max(first, 1e-6))))):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return round(1000 * best, 3)


def layer_figures(shapes, rows, formats) -> list[dict]:
    out = []
    for k, n in shapes:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(n, k, generator=g) * 0.02
        wb = w.bfloat16()
        for m in rows:
            x = torch.randn(m, k, generator=g)
            xb = x.bfloat16()
            case = {"K": k, "N": n, "M": m,
                    "fp32_ms": best_ms(lambda: F.linear(x, w)),
                    "bf16_ms": best_ms(lambda: F.linear(xb, wb)),
                    "fp32_batch_invariant_ms": best_ms(lambda: batch_invariant_linear(x, w))}
            if native.available():
                packed = native.pack_f32(w)
                case["fp32_native_ms"] = best_ms(lambda: native.linear_f32(x, packed))
            for name in formats:
                scheme = SCHEMES[name]
                qw = scheme.quantize(w)
                case[f"{name}_ms"] = best_ms(lambda: scheme.linear(x, qw))
            out.append(case)
            print(json.dumps(case), flush=True)
    return out


def build_model(name: str):
    from qarl.model import CausalLM, ModelConfig, load_model

    if name == "qwen3-109m":
        torch.manual_seed(0)
        return CausalLM(ModelConfig(**QWEN3_109M)).eval()
    return load_model(name).eval()


LM_HEAD_SUFFIX = "+lm_head"


def decode_figures(models, batches, formats, new_tokens, repeats, prompt_len,
                   lm_head: str = "engine") -> tuple[str, list]:
    """Every format's engine is built first and the timed calls are interleaved (format after
    format, repeat after repeat), so drifts of the machine's speed hit all formats alike."""
    from qarl.rollout import LocalEngine
    from qarl.types import SamplingParams

    variants = [(f, False) for f in formats if lm_head in ("engine", "both")]
    variants += [(f, True) for f in formats if lm_head in ("quantized", "both")]
    out = []
    for model_name in models:
        engines = {}
        for fmt, with_head in [("fp32", False)] + sorted(variants):
            model = build_model(model_name)
            if fmt != "fp32":
                include = ["model.layers.*", "lm_head"] if with_head else None
                quantize_model(model, fmt, mode="kernel", include=include)
            name = fmt + LM_HEAD_SUFFIX if with_head else fmt
            engines[name] = LocalEngine(model, eos_token_ids=(), pad_token_id=0)
        for batch in batches:
            prompts = torch.randint(1, engines["fp32"].model.config.vocab_size, (batch, prompt_len),
                                    generator=torch.Generator().manual_seed(batch)).tolist()

            def generate(engine, n):
                engine.generate(prompts, SamplingParams(max_new_tokens=n, greedy=True), seed=0)

            for engine in engines.values():
                generate(engine, 2)  # warm-up, and prepares the kernel operands once
            best = {(fmt, n): float("inf") for fmt in engines for n in (1, new_tokens)}
            for _ in range(repeats):
                for fmt, engine in engines.items():
                    for n in (new_tokens, 1):
                        start = time.perf_counter()
                        generate(engine, n)
                        best[fmt, n] = min(best[fmt, n], time.perf_counter() - start)
            for fmt in engines:
                ms = 1000 * (best[fmt, new_tokens] - best[fmt, 1]) / (new_tokens - 1)
                case = {"model": model_name, "format": fmt, "batch": batch, "ms_per_step": round(ms, 2)}
                out.append(case)
                print(json.dumps(case), flush=True)
        del engines
    return ("qarl.rollout.LocalEngine (greedy; lm_head prepacked fp32, or quantized for "
            f"'{LM_HEAD_SUFFIX}'), formats interleaved"), out


BLOCK_SHAPES = {  # d, ffn, heads, kv heads, head dim, q/k norm (Qwen3)
    "smollm2-135m": (576, 1536, 9, 3, 64, False),
    "qwen3-109m": (1024, 3072, 16, 8, 64, True),
}


def _block(scheme, d, ffn, H, Hkv, D, qk_norm, g):
    """A DecodeBlock of random weights under `scheme`, or None if its GEMMs are not native."""
    gemms = []
    for n, k in (((H + 2 * Hkv) * D, d), (d, H * D), (2 * ffn, d), (d, ffn)):
        qw = scheme.quantize(torch.randn(n, k, generator=g) * 0.02)
        operand = scheme.native_operand(qw, torch.device("cpu"))
        if operand is None:
            return None
        gemms.append(native.BlockGemm(*operand))
    norm = torch.ones(D) if qk_norm else None
    return native.DecodeBlock(*gemms, torch.ones(d), torch.ones(d), (1e-6, 1e-6), H, Hkv, D,
                              q_norm=norm, k_norm=norm, qk_eps=1e-6 if qk_norm else 0.0)


def block_figures(models, batches, formats, layers: int = 30, keys: int = 33) -> list[dict]:
    out = []
    for model_name in models:
        d, ffn, H, Hkv, D, qk_norm = BLOCK_SHAPES[model_name]
        for name in formats:
            g = torch.Generator().manual_seed(0)
            blocks = [_block(SCHEMES[name], d, ffn, H, Hkv, D, qk_norm, g) for _ in range(layers)]
            if blocks[0] is None:
                continue
            for batch in batches:
                caches = [torch.randn(2, batch, Hkv, keys, D, generator=g) for _ in range(layers)]
                cos, sin = torch.ones(1, 1, 1, D), torch.zeros(1, 1, 1, D)
                x = torch.randn(batch, 1, d, generator=g)

                def step():
                    h = x
                    for block, cache in zip(blocks, caches):
                        h = block(h, cos, sin, cache[0], cache[1], keys - 1, None)

                case = {"model": model_name, "format": name, "batch": batch,
                        "blocks": layers, "ms_per_step": best_ms(step)}
                out.append(case)
                print(json.dumps(case), flush=True)
    return out


def isa_times(levels: tuple[str, ...], use, call) -> dict[str, float]:
    """ms of `call()` under each instruction set of `levels` (native.S8_ISAS / F32_ISAS) this
    CPU runs, `use` switching (native.use_s8_isa / use_f32_isa); back to the best after."""
    times = {}
    for isa in levels:
        if use(isa) == isa:
            times[f"native_{isa}_ms"] = best_ms(call)
    use(levels[-1])
    return times


def int8_figures(shapes, rows) -> list[dict]:
    """Part 4 (module docstring): ms per W8A8 layer call by int8 GEMM path."""
    scheme, out = SCHEMES["w8a8-int8"], []
    for k, n in shapes:
        w = torch.randn(n, k) * 0.05
        qw = scheme.quantize(w)
        packed = native.pack_s8(qw.codes, qw.scales)
        wt = qw.codes.t().contiguous()
        for m in rows:
            x = torch.randn(m, k)
            case = {"m": m, "k": k, "n": n, "fp32_ms": best_ms(lambda: F.linear(x, w)),
                    **isa_times(native.S8_ISAS, native.use_s8_isa,
                                lambda: native.linear_s8_dynamic(x, packed))}

            def int_mm():  # torch._int_mm takes 17+ rows on CPU: fewer are padded, as in the format
                xq, xs = native.quantize_s8_rows(x)
                rows_in = xq if m > 16 else F.pad(xq, (0, 0, 0, 17 - m))
                return native.scale_s32(torch._int_mm(rows_in, wt)[:m], xs, qw.scales)

            case["int_mm_ms"] = best_ms(int_mm)
            out.append(case)
            print(json.dumps(case), flush=True)
    return out


def f32_figures(shapes, rows) -> list[dict]:
    """Part 5 (module docstring): ms per fp32 layer call by instruction set."""
    out = []
    for k, n in shapes:
        w = torch.randn(n, k) * 0.05
        packed = native.pack_f32(w)
        for m in rows:
            x = torch.randn(m, k)
            case = {"m": m, "k": k, "n": n, "fp32_F.linear_ms": best_ms(lambda: F.linear(x, w)),
                    **isa_times(native.F32_ISAS, native.use_f32_isa,
                                lambda: native.linear_f32(x, packed))}
            out.append(case)
            print(json.dumps(case), flush=True)
    return out


def add_speedups(cases: list[dict]) -> None:
    base = {(c["model"], c["batch"]): c["ms_per_step"] for c in cases if c["format"] == "fp32"}
    for c in cases:
        c["speedup_vs_fp32"] = round(base[c["model"], c["batch"]] / c["ms_per_step"], 2)


def write_results(report: dict, models: list[str]) -> None:
    """`--results`: the decode part's ms/step per model, format and batch into docs/results.md,
    with W8A8's speed over fp32 on the default model as the glance."""
    from results_page import this_command, write_section

    cases = report["decode"]
    batches = list(dict.fromkeys(c["batch"] for c in cases))
    ms = {(c["model"], c["format"], c["batch"]): c for c in cases}
    head = ["model", "format", *(f"batch {b}" for b in batches)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for model, fmt in dict.fromkeys((c["model"], c["format"]) for c in cases):
        cells = [f"{ms[model, fmt, b]['ms_per_step']:.2f} "
                 f"({ms[model, fmt, b]['speedup_vs_fp32']:.2f}x)" for b in batches]
        lines.append(f"| {model} | `{fmt}` | " + " | ".join(cells) + " |")
    notes = (f"{report['decode_engine']}: ms per decode step, (t(N tokens) - t(1 token)) / "
             "(N - 1), the best of the repeats; in brackets the speed against `fp32` on the same "
             f"model and batch; {report['threads']} torch threads. qwen3-109m: random weights of "
             "the 109M Qwen3 config.")
    model = "smollm2-135m" if "smollm2-135m" in models else models[0]
    formats = [f for f in dict.fromkeys(c["format"] for c in cases if c["model"] == model)
               if f != "fp32"]
    glance = None
    if formats:
        fmt = "w8a8-int8" if "w8a8-int8" in formats else formats[0]
        glance = (f"decode, `{fmt}` vs fp32 ({model})",
                  " / ".join(f"{ms[model, fmt, b]['speedup_vs_fp32']:.2f}x" for b in batches)
                  + f" at batch {' / '.join(map(str, batches))}")
    write_section("decode", "Quantized decode speed", this_command(), "\n".join(lines),
                  notes=notes, glance=glance)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="layers,decode")
    parser.add_argument("--formats", default=",".join(sorted(SCHEMES)))
    parser.add_argument("--shapes", default="1024x4096,4096x1024", help="KxN,...")
    parser.add_argument("--rows", default="1,16,256")
    parser.add_argument("--models", default="qwen3-109m,smollm2-135m")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--new-tokens", type=int, default=9)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--lm-head", choices=["engine", "quantized", "both"], default="engine",
                        help="decode: lm_head in fp32 (engine), quantized too, or both rows")
    parser.add_argument("--results", action="store_true",
                        help="write the decode part into docs/results.md (section decode)")
    args = parser.parse_args(argv)
    if args.results and "decode" not in args.parts.split(","):
        parser.error(f"--results writes the decode part's figures; --parts {args.parts} has no "
                     "decode: add it")
    torch.set_num_threads(args.threads)
    formats = args.formats.split(",")
    for f in formats:
        SCHEMES[f]  # unknown names raise with the valid list
    report = {"benchmark": "quant_kernels", "torch": torch.__version__, "threads": args.threads,
              "machine": platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "native_kernels": native.available() or native.why_unavailable(),
              "load_average_before": list(os.getloadavg())}
    parts = args.parts.split(",")
    if "layers" in parts:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        report["layers"] = layer_figures(shapes, [int(r) for r in args.rows.split(",")], formats)
    if "decode" in parts:
        engine, cases = decode_figures(
            args.models.split(","), [int(b) for b in args.batches.split(",")], formats,
            args.new_tokens, args.repeats, args.prompt_len, args.lm_head,
        )
        add_speedups(cases)
        report["decode_engine"], report["decode"] = engine, cases
    if "blocks" in parts:
        if not native.available():
            raise SystemExit(f"--parts blocks needs qarl.native: {native.why_unavailable()}")
        report["blocks"] = block_figures(
            [m for m in args.models.split(",") if m in BLOCK_SHAPES],
            [int(b) for b in args.batches.split(",")], formats)
    if "int8" in parts:
        if not native.available():
            raise SystemExit(f"--parts int8 needs qarl.native: {native.why_unavailable()}")
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        report["int8"] = int8_figures(shapes, [int(r) for r in args.rows.split(",")])
        report["int8_isa_here"] = native.s8_isa()
    if "f32" in parts:
        if not native.available():
            raise SystemExit(f"--parts f32 needs qarl.native: {native.why_unavailable()}")
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        report["f32"] = f32_figures(shapes, [int(r) for r in args.rows.split(",")])
        report["f32_isa_here"] = native.f32_isa()
    report["load_average_after"] = list(os.getloadavg())
    print(json.dumps(report, indent=1))
    if args.results:
        write_results(report, args.models.split(","))
    return report


if __name__ == "__main__":
    main()
