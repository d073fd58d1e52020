"""How far each phase of an RL step is from what this machine can do: its work, the machine's
rates at the phase's own shapes measured in the same process, the floor they give, the
measured seconds and their ratio, as one JSON object.

    .venv/bin/python benchmarks/roofline.py                          # the default recipe
    .venv/bin/python benchmarks/roofline.py --set quant.scheme=none  # its full-precision twin
    .venv/bin/python benchmarks/roofline.py --results                # its section of the page

Run it on a quiet machine: the floors come from the fastest of a few timed calls, the
measured phases from whole steps, so a neighbour slows the second more than the first.

Work per phase, counted from the step's own batch (the mean over steps 2..N, step 1 a
warm-up; every response runs to rollout.max_new_tokens so every step does the same work,
unless `--eos` lets them end at their end token):

- update: the FLOPs of every product of the gradient pass. Per micro-batch the decoder's
  linear layers see each distinct prompt once plus the packed response positions that
  predict another token (`qarl.train.learner.logprobs`), the lm_head sees the response
  positions; forward 2, backward 4 FLOPs per weight per row, plus one more forward of the
  layers under train.gradient_checkpointing and of the lm_head for every logits chunk but
  the last; attention 4 x heads x head_dim x context per row and layer, forward, 3x with
  its backward. And the optimizer steps' bytes (`optimizer_bytes`): per trainable parameter
  AdamW reads the weight, its gradient and two moments and writes the weight and the moments
  (Muon's momentum: one state; its Newton-Schulz products are not counted, so the floor stays
  a lower bound), and a clip reads the gradient once more. The table splits the update's
  measured seconds into the gradient pass and the optimizer steps (timed around
  `qarl.train.learner.update.optimizer_step`), each beside its own floor.
- old_logp: the replay of the rows the step replayed (the batches `Learner.replay` was
  given), decode-shaped like generation: the prefill of their distinct prompts and their
  decode steps' FLOPs, and the bytes of the learner's packed weights read once per decode
  step.
- generate: prefill FLOPs (each distinct prompt once, the engine shares them) and every
  decode step's FLOPs over its live rows, and the bytes each decode step streams: the
  engine's weights once (what a whole push sends: codes, scales, the tied head) and its KV
  cache.
- sync: the bytes a push moves: the master weights read, the pushed state written.

Rates, measured here at those shapes: the learner's GEMM (`qarl.quant.kernels.learner_mm` in
the gradient pass's dtype) timed on each decoder linear's forward, input-gradient and
weight-gradient products at the update's mean rows per micro-batch, and on the lm_head's;
the engine's kernel (`Scheme.linear` of the recipe's format; the lm_head, and every layer of
a full-precision engine, as its decode plan packs a plain fp32 linear) at prefill and at
decode rows, the decoder's linears of one input size stacked into one weight so the timing is
the kernel's rate, not one Python call per layer (`engine_linears_seconds`); memory
bandwidth as a streaming read of a buffer far larger than the caches. A phase's floor is its
work at those rates (for a decode step, the larger of its FLOPs and its bytes over the
rates: the roofline); `x floor` is measured / floor. The update's floor counts its products
in the learner's precision, and those the gradient pass runs on the format's kernel (the
forward in kernel alignment, dL/dx with the backward on codes: `kernel_products`) at that
kernel's speed at the same shapes: the cost the gradient pass cannot go under without
changing its arithmetic; everything above it is overhead (Python, autograd, elementwise
passes, copies). The optimizer steps' floor is their bytes at the memory bandwidth.

`--results` writes the table into docs/results.md as the section of this machine's class
(`roofline-avx2`, `roofline-avx512`, `roofline-amx`, `roofline-cuda`): one table per class,
and one more per class for a run with overrides (`roofline-avx2-quant.scheme-none`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import time

import qarl

qarl.ask_huge_pages()  # before torch loads, as the `qarl` command does (docs/performance.md)
import torch  # noqa: E402
from torch import nn  # noqa: E402

from qarl.config import load_config, parse_overrides  # noqa: E402
from qarl.native.memory import tune_allocator  # noqa: E402

PHASES = ("generate", "old_logp", "update", "sync")


# ---- the machine's rates ---------------------------------------------------------------------


def best_seconds(fn, repeats: int = 5) -> float:
    """The fastest of `repeats` timed calls after one warm-up call: the machine's rate, not
    a neighbour's interruptions."""
    fn()
    best = math.inf
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def bandwidth_gbs(megabytes: int = 1024) -> float:
    """GB/s of a streaming read of a buffer far larger than the caches: the faster of a sum
    and a matrix-vector product over it (a decode step's read)."""
    buf = torch.ones(megabytes * 2**20 // 4)
    rows, vec = buf.view(-1, 4096), torch.ones(4096, 1)
    seconds = min(best_seconds(lambda: buf.sum(), 3), best_seconds(lambda: rows @ vec, 3))
    return buf.numel() * 4 / seconds / 1e9


def learner_gemm_seconds(rows: int, k: int, n: int, dtype: torch.dtype) -> dict[str, float]:
    """Seconds of the three products of a linear layer [k -> n] at `rows` rows in the learner's
    GEMM: forward x W^T, input gradient g W, weight gradient g^T x."""
    from qarl.quant.kernels import learner_mm

    x, w, g = torch.randn(rows, k, dtype=dtype), torch.randn(n, k, dtype=dtype), \
        torch.randn(rows, n, dtype=dtype)
    return {"forward": best_seconds(lambda: learner_mm(x, w.t())),
            "grad_x": best_seconds(lambda: learner_mm(g, w)),
            "grad_w": best_seconds(lambda: learner_mm(g.t(), x))}


def engine_gemm_seconds(scheme_name: str, rows: int, k: int, n: int) -> float:
    """Seconds of the engine's kernel of `scheme_name` on [rows, k] x [k -> n]; a full-precision
    one (and the lm_head) as the decode plan runs a plain fp32 linear: packed once
    (`qarl.rollout.prepack`: qarl.native's panels, else oneDNN's blocked weight)."""
    from qarl.quant import SCHEMES

    scheme = SCHEMES[scheme_name]
    x = torch.randn(rows, k)
    if scheme.is_identity:
        from qarl.rollout.fused import linear
        from qarl.rollout.prepack import linear_source

        _, build = linear_source(nn.Linear(k, n, bias=False), rows)
        packed = build()
        return best_seconds(lambda: linear(x, packed, None))
    qw = scheme.quantize(torch.randn(n, k) * 0.02)
    return best_seconds(lambda: scheme.linear(x, qw, None))


STACK_BYTES = 64 * 2**20  # the fp32 size of the largest stacked weight engine_linears_seconds times


def engine_linears_seconds(scheme_name: str, rows: int, linears) -> float:
    """Seconds of the engine's kernel over all the decoder's linears at `rows` rows: for each
    input size, the output rows of every linear that takes it stacked into one weight (a MoE
    expert's by its share of the rows), timed up to STACK_BYTES and scaled to the whole. The
    kernel's rate at those rows, without one call per layer: a decode step runs each block's
    projections stacked, or the whole block in one native call (`qarl.rollout.fused`)."""
    outputs: dict[int, float] = {}
    for k, n, share in linears:
        outputs[k] = outputs.get(k, 0.0) + n * share
    seconds = 0.0
    for k, total in outputs.items():
        n = max(16, min(round(total), STACK_BYTES // (4 * k)))
        seconds += engine_gemm_seconds(scheme_name, rows, k, n) * total / n
    return seconds


# ---- the work --------------------------------------------------------------------------------


def block_linears(model: nn.Module) -> list[tuple[int, int, float]]:
    """(in, out, share of rows it sees) of every linear layer inside the decoder blocks: 1 for
    a dense layer, top-k / experts for a MoE expert's."""
    config = model.config
    share = (config.num_experts_per_tok / config.num_experts) if config.num_experts else 1.0
    out = []
    for name, module in model.model.layers.named_modules():
        if hasattr(module, "in_features") and hasattr(module, "out_features"):
            expert = ".experts." in f".{name}."
            out.append((module.in_features, module.out_features, share if expert else 1.0))
    return out


def attention_flops(config, rows_context: float) -> float:
    """Forward FLOPs of attention (Q K^T and the weighted sum of V) over `rows_context`, the
    sum over rows of each row's context length."""
    return 4 * config.num_heads * config.head_dim * config.num_layers * rows_context


def update_work(batch, config, train, algo) -> dict:
    """The update's rows per micro-batch and its FLOPs (module docstring)."""
    N, P = batch.num_sequences, batch.prompt_ids.shape[1]
    size, chunk = train.micro_batch_size, 512  # logprobs.response_logprobs' chunk_tokens
    blocks = block_rows = head_rows = recompute_head = context = 0
    for start in range(0, N, size):
        rows = slice(start, min(N, start + size))
        prompts = torch.unique(batch.prompt_ids[rows], dim=0).shape[0]
        mask = batch.response_mask[rows]
        packed = int(mask[:, 1:].sum())
        block_rows += prompts * P + packed
        head = int(mask.sum())
        head_rows += head
        recompute_head += max(0, math.ceil(head / chunk) - 1) * chunk
        lengths = mask.sum(1).float()
        context += prompts * P * P / 2 + float((lengths * (P + lengths / 2)).sum())
        blocks += 1
    return {"micro_batches": blocks * algo.epochs, "block_rows": block_rows * algo.epochs,
            "head_rows": head_rows * algo.epochs, "head_recompute_rows":
            min(recompute_head, head_rows) * algo.epochs, "context": context * algo.epochs}


def update_floor(work: dict, linears, config, dtype, checkpointing: bool,
                 int8: tuple[str, ...] = (), scheme: str = "none") -> tuple[float, float]:
    """(FLOPs, floor seconds) of the update: every product at the learner GEMM's measured
    speed at the update's mean rows per micro-batch; the decoder linears' products named in
    `int8` ("forward", "grad_x") at the speed of `scheme`'s kernel instead, where the
    gradient pass runs them on it (`kernel_products`)."""
    mb = work["micro_batches"]
    rows = max(1, round(work["block_rows"] / mb))
    forwards = 2 if checkpointing else 1
    flops = seconds = 0.0
    shapes: dict[tuple[int, int], int] = {}
    for k, n, share in linears:
        shapes[(k, n)] = shapes.get((k, n), 0) + share
    for (k, n), count in shapes.items():
        m = max(1, round(rows * min(1.0, count)))
        t = learner_gemm_seconds(m, k, n, dtype)
        if "forward" in int8:
            t["forward"] = engine_gemm_seconds(scheme, m, k, n)
        if "grad_x" in int8:  # g [m, n] on the codes [n, k]: a GEMM of n -> k
            t["grad_x"] = engine_gemm_seconds(scheme, m, n, k)
        seconds += mb * (t["forward"] * forwards + t["grad_x"] + t["grad_w"]) * max(1.0, count)
        flops += 2 * k * n * count * work["block_rows"] * (forwards + 2)
    H, V = config.hidden_size, config.vocab_size
    head_rows = max(1, round(work["head_rows"] / mb))
    t = learner_gemm_seconds(head_rows, H, V, dtype)
    head_forwards = 1 + work["head_recompute_rows"] / max(1, work["head_rows"])
    seconds += mb * (t["forward"] * head_forwards + t["grad_x"] + t["grad_w"])
    flops += 2 * H * V * work["head_rows"] * (head_forwards + 2)
    attn = attention_flops(config, work["context"]) * (forwards + 2)
    gemm_rate = flops / seconds
    return flops + attn, seconds + attn / gemm_rate


def optimizer_bytes(model: nn.Module, config) -> float:
    """The bytes an update's optimizer steps move at the least (module docstring): per step,
    each trainable parameter's weight, gradient and state read and weight and state written,
    and its gradient read once more by a clip."""
    from qarl.train.learner.optim import muon_parameter_names

    muon = set(muon_parameter_names(model)) if config.train.optimizer == "muon" else set()
    clip = 1 if config.train.grad_clip > 0 else 0
    per_step = 0.0
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        states = 1 if name in muon else 2  # Muon's momentum; AdamW's two moments
        # read weight, gradient and states; write weight and states; the clip's read
        per_step += p.numel() * p.element_size() * (2 + states + 1 + states + clip)
    return per_step * config.algo.epochs * config.train.mini_batches


def decode_floor(scheme: str, linears, config, rows_per_step: list[int], weight_bytes: float,
                 bandwidth: float, context: float) -> tuple[float, float, float]:
    """(FLOPs, bytes, floor seconds) of decode steps with `rows_per_step` live rows each:
    per step the larger of its products at the engine kernel's speed and its bytes (the
    weights once, and the KV cache: `context`, the sum over rows and steps of the positions
    attended, spread evenly over the steps) at the bandwidth."""
    H, V = config.hidden_size, config.vocab_size
    kv_bytes_per_row_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    speed: dict[int, float] = {}
    flops = nbytes = seconds = 0.0
    steps = max(1, len(rows_per_step))
    for live in rows_per_step:
        if live not in speed:
            speed[live] = engine_linears_seconds(scheme, live, linears) + \
                engine_gemm_seconds("none", live, H, V)
        step_flops = 2 * live * (sum(k * n * s for k, n, s in linears) + H * V)
        step_bytes = weight_bytes + kv_bytes_per_row_token * context / steps
        flops, nbytes = flops + step_flops, nbytes + step_bytes
        seconds += max(speed[live], step_bytes / (bandwidth * 1e9))
    return flops, nbytes, seconds


def engine_pass_floor(scheme: str, linears, config, batch, weight_bytes: float,
                      bandwidth: float) -> tuple[float, float, int, float]:
    """(FLOPs, bytes, decode steps, floor seconds) of the engine generating or replaying
    `batch`: the prefill of its distinct prompts (the engine shares them) and a decode step
    per response position over the rows still live there."""
    P = batch.prompt_ids.shape[1]
    prompts = torch.unique(batch.prompt_ids, dim=0).shape[0]
    lengths = batch.response_mask.sum(1)
    live = [int((lengths > t).sum()) for t in range(int(lengths.max()))]
    context = float((lengths * (P + lengths / 2)).sum())
    pf_flops, pf_floor = prefill_floor(scheme, linears, config, prompts * P)
    d_flops, d_bytes, d_floor = decode_floor(scheme, linears, config, live, weight_bytes,
                                             bandwidth, context)
    return pf_flops + d_flops, d_bytes, len(live), pf_floor + d_floor


def prefill_floor(scheme: str, linears, config, rows: int) -> tuple[float, float]:
    """(FLOPs, floor seconds) of a prefill of `rows` prompt positions (the head at the last
    position of each prompt is left out: one row per prompt)."""
    if rows == 0:
        return 0.0, 0.0
    return 2 * rows * sum(k * n * s for k, n, s in linears), \
        engine_linears_seconds(scheme, rows, linears)


# ---- one run ---------------------------------------------------------------------------------


def measure(recipe: str, overrides: dict, steps: int, ignore: bool) -> dict:
    from qarl.train.folder import open_run
    from qarl.train.learner import update as update_module
    from qarl.train.learner.precision import Precision
    from qarl.train.sft import warm_start

    out = tempfile.mkdtemp(prefix="qarl-roofline-")
    config = load_config(recipe, {"run.output_dir": out, "run.resume": False,
                                  "log.progress": False, "eval.size": 8, "run.name": "roofline",
                                  **overrides})
    # the optimizer steps' seconds, within each update (update_policy calls it by this name)
    stepping, optimizer_seconds = update_module.optimizer_step, [0.0]

    def timed_step(*args, **kwargs):
        start = time.perf_counter()
        try:
            return stepping(*args, **kwargs)
        finally:
            optimizer_seconds[0] += time.perf_counter() - start

    update_module.optimizer_step = timed_step
    try:
        with open_run(config, learner=warm_start(config)) as (_, policy, data):
            rows = run_steps(policy, data, config, steps, ignore, optimizer_seconds)
            model = policy.learner.model
            precision = Precision.of(config.train, config.quant)
    finally:
        update_module.optimizer_step = stepping
    return reckon(config, model, precision, rows)


def run_steps(policy, data, config, steps: int, ignore: bool,
              optimizer_seconds: list[float]) -> list[tuple[dict, object, list]]:
    """`steps` RL steps: after the first, each one's (metrics, with its optimizer steps'
    seconds as `time/optimizer`; the update's batch; the batches its old_logp replayed)."""
    from qarl.train.trainer import rl_step

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from step_time import ignore_eos

    if ignore:
        ignore_eos("roofline", policy)
    policy.sync.push()
    seen: dict = {}
    update, replay = policy.learner.update, policy.learner.replay

    def recorded(exp, *args, **kwargs):
        seen["batch"] = exp.batch
        return update(exp, *args, **kwargs)

    def recorded_replay(batch, *args, **kwargs):
        seen["replayed"].append(batch)
        return replay(batch, *args, **kwargs)

    policy.learner.update, policy.learner.replay = recorded, recorded_replay
    rows = []
    for step in range(steps):
        optimizer_seconds[0], seen["replayed"] = 0.0, []
        metrics = rl_step(policy, data, config, step)
        if step > 0:
            rows.append(({**metrics, "time/optimizer": optimizer_seconds[0]}, seen["batch"],
                         seen["replayed"]))
    return rows


def kernel_products(config, precision, device: torch.device = torch.device("cpu")
                    ) -> tuple[str, ...]:
    """Which products of the decoder's quantized linears the gradient pass runs on the
    format's kernel rather than the learner's GEMM: the forward in kernel alignment where
    `Scheme.kernel_for_gradients` holds, and dL/dx where the backward multiplies on the
    weight's codes (`CodesPass.grad_input_on_codes`). dL/dW stays the learner's GEMM."""
    from qarl.quant import SCHEMES

    scheme = SCHEMES[config.quant.scheme]
    if scheme.is_identity or config.quant.align != "kernel":
        return ()
    out = ("forward",) if scheme.kernel_for_gradients(device, precision.compute) else ()
    codes = scheme.codes_pass()
    if precision.quant_backward == "codes" and codes is not None and codes.grad_input_on_codes:
        out += ("grad_x",)
    return out


def reckon(config, model, precision, rows) -> dict:
    """The table's figures from the measured steps (module docstring)."""
    linears = block_linears(model)
    mc = model.config
    mean = lambda key: sum(m.get(key, 0.0) for m, *_ in rows) / len(rows)  # noqa: E731
    measured = {p: mean(f"time/{p}") for p in PHASES}
    weight_bytes = mean("sync/full_megabytes") * 2**20  # what a decode step reads
    bandwidth = bandwidth_gbs()
    scheme = config.quant.scheme
    figures: dict[str, dict] = {}

    # update
    work = [update_work(b, config, config.train, config.algo) for _, b, _ in rows]
    w = {k: sum(x[k] for x in work) / len(work) for k in work[0]}
    int8 = kernel_products(config, precision, next(model.parameters()).device)
    flops, floor = update_floor(w, linears, mc, precision.compute,
                                config.train.gradient_checkpointing, int8, scheme)
    on_kernel = f"; {scheme} kernel: {' and '.join(int8)}" if int8 else ""
    o_bytes = optimizer_bytes(model, config)
    o_floor = o_bytes / (bandwidth * 1e9)
    gemm = (f"{flops / floor / 1e9:.0f} GFLOP/s ({str(precision.compute).removeprefix('torch.')}"
            f" GEMM{on_kernel})")
    figures["update"] = {"work": f"{flops / 1e9:.0f} GFLOP, {o_bytes / 1e9:.1f} GB",
                         "rate": f"{gemm}; {bandwidth:.0f} GB/s", "floor": floor + o_floor}
    optimizer = mean("time/optimizer")
    parts = {"gradient pass": {"work": f"{flops / 1e9:.0f} GFLOP", "rate": gemm,
                               "floor": floor, "measured": measured["update"] - optimizer},
             "optimizer steps": {"work": f"{o_bytes / 1e9:.1f} GB",
                                 "rate": f"{bandwidth:.0f} GB/s", "floor": o_floor,
                                 "measured": optimizer}}

    # generate: prefill + decode steps (the last step's batch)
    _, batch, replays = rows[-1]
    g_flops, g_bytes, g_steps, g_floor = engine_pass_floor(scheme, linears, mc, batch,
                                                           weight_bytes, bandwidth)
    from qarl.quant import SCHEMES

    # what decodes: the format's kernel, or a full-precision engine's packed fp32 GEMM
    kernel = "fp32 GEMM" if SCHEMES[scheme].is_identity else f"{scheme} kernel"
    figures["generate"] = {"work": f"{g_flops / 1e9:.0f} GFLOP, {g_bytes / 1e9:.1f} GB over "
                           f"{g_steps} decode steps", "rate": f"{bandwidth:.0f} GB/s; {kernel}",
                           "floor": g_floor}

    # old_logp: the same step's replays, decode-shaped
    if replays:
        passes = [engine_pass_floor(scheme, linears, mc, b, weight_bytes, bandwidth)
                  for b in replays]
        r_rows = sum(b.num_sequences for b in replays)
        figures["old_logp"] = {"work": f"{r_rows} rows replayed: "
                               f"{sum(p[0] for p in passes) / 1e9:.0f} GFLOP, "
                               f"{sum(p[1] for p in passes) / 1e9:.1f} GB",
                               "rate": f"{bandwidth:.0f} GB/s; {kernel}",
                               "floor": sum(p[3] for p in passes)}
    else:
        figures["old_logp"] = {"work": "no rows replayed", "rate": "-", "floor": 0.0}

    # sync: read the master weights, write the pushed state
    master = sum(p.numel() * p.element_size() for p in model.parameters())
    s_bytes = master + weight_bytes
    figures["sync"] = {"work": f"{s_bytes / 1e9:.2f} GB", "rate": f"{bandwidth:.0f} GB/s",
                       "floor": s_bytes / (bandwidth * 1e9)}

    for phase, f in figures.items():
        f["measured"] = measured[phase]
    for f in [*figures.values(), *parts.values()]:
        f["measured"] = round(f["measured"], 3)
        f["floor"] = round(f["floor"], 4)  # a tiny model's sync: well under 1 ms
        f["x_floor"] = round(f["measured"] / f["floor"], 1) if f["floor"] > 0 else None
    step = mean("time/generate") + mean("time/reward") + mean("time/old_logp") + \
        mean("time/ref_logp") + mean("time/update") + mean("time/sync")
    floor = sum(f["floor"] for f in figures.values())
    return {"phases": figures, "update_parts": parts,
            "step": {"measured": round(step, 3), "floor": round(floor, 3),
                     "x_floor": round(step / floor, 1)},
            "update_work": {k: round(v) for k, v in w.items()},
            "bandwidth_gbs": round(bandwidth, 1), "recipe_scheme": scheme,
            "compute": str(precision.compute), "steps_measured": len(rows)}


# ---- the page --------------------------------------------------------------------------------


def class_key() -> str:
    """The results page section of this machine's class: roofline-amx, -avx512, -avx2."""
    from qarl.native.isa import isa_levels

    if torch.cuda.is_available():
        return "roofline-cuda"
    levels = isa_levels()
    if any(level.startswith("amx") for level in levels):
        return "roofline-amx"
    if "avx512" in levels:
        return "roofline-avx512"
    return "roofline-avx2"


def write_results(result: dict, label: str, overrides: list[str]) -> None:
    from results_page import this_command, write_section

    lines = ["| phase | work | rate here | floor (s) | measured (s) | x floor |",
             "|---|---|---|---|---|---|"]
    rows = [(p, result["phases"][p]) for p in PHASES]
    at = PHASES.index("update") + 1
    rows[at:at] = [(f"update: {part}", f) for part, f in result["update_parts"].items()]
    for phase, f in rows:
        x = "-" if f["x_floor"] is None else f"{f['x_floor']:.1f}x"
        lines.append(f"| {phase} | {f['work']} | {f['rate']} | {f['floor']:.2f} | "
                     f"{f['measured']:.2f} | {x} |")
    s = result["step"]
    lines.append(f"| **step** | | | {s['floor']:.2f} | {s['measured']:.2f} | "
                 f"{s['x_floor']:.1f}x |")
    notes = (f"{label}: seconds per step, the mean of steps 2..N (step 1 a warm-up), every "
             "response run to rollout.max_new_tokens. Floor: the phase's work at this "
             "machine's rates measured in the same process at the phase's shapes (the update's "
             "products in the learner's GEMM and precision, those it runs on the format's "
             "kernel, named in its rate, at that kernel's speed; generation and the replay by the "
             "format's kernel and the memory bandwidth, each decode step the larger of the "
             "two; the optimizer steps' bytes at the bandwidth); the update's two parts: its "
             "gradient pass and its optimizer steps, timed within it; x floor: measured / "
             "floor. How the work is counted: the docstring of benchmarks/roofline.py.")
    key = class_key()
    title = "Roofline of an RL step (" + key.removeprefix("roofline-").upper()
    if overrides:
        key += "-" + "-".join(re.sub(r"[^a-z0-9._]+", "-", o.lower()) for o in overrides)
        title += ", " + ", ".join(overrides)
    title += ")"
    glance = (f"RL step against this machine's floor ({label})",
              f"{s['x_floor']:.1f}x the floor ({s['measured']:.2f} s vs {s['floor']:.2f} s)")
    write_section(key, title, this_command(), "\n".join(lines), notes=notes, glance=glance)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="default")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override, e.g. quant.scheme=none (repeatable)")
    parser.add_argument("--steps", type=int, default=6,
                        help="steps, the first a warm-up (step 2 still faults heap pages in)")
    parser.add_argument("--eos", action="store_true",
                        help="let responses end at EOS (default: every one runs to the budget)")
    parser.add_argument("--results", action="store_true", help="write docs/results.md")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first is a warm-up)")
    tune_allocator()
    overrides = parse_overrides([f"--{kv}" for kv in args.set])
    result = measure(args.recipe, overrides, args.steps, not args.eos)
    result["recipe"] = args.recipe
    result["overrides"] = args.set
    print(json.dumps(result, indent=1))
    if args.results:
        label = f"recipe `{args.recipe}`" + (f" with {', '.join(args.set)}" if args.set else "")
        write_results(result, label, args.set)


if __name__ == "__main__":
    main()
