#!/usr/bin/env bash
# qarl's CUDA check for an air-gapped GPU machine (docs/install.md). It uses the machine's own
# python3 and its CUDA build of torch (>= 2.9), installs the carried wheels and qarl with
# --no-index --no-deps into a temporary folder, builds its models in code and downloads
# nothing. First, on a machine that can download: `bash benchmarks/gpu_wheels.sh 3.12` (the GPU
# machine's Python); carry .gpu-wheels/ with the checkout; then there:
#
#     bash benchmarks/gpu_check.sh                        # $OUT/gpu_check.json, else ./
#     bash benchmarks/gpu_check.sh --device cpu --quick   # the same path dry-run on a CPU
#
#   --device D     cuda (default), cuda:N or cpu
#   --quick        the dry run's sizes: the tiny model only, 2 steps, two step-time arms; on a
#                  CPU every part's limit doubles and the budget is 900 s unless given
#   --python PY    the interpreter holding torch (default: python3)
#   --wheels DIR   the carried wheels (default: .gpu-wheels/py<X.Y>-<machine>, PY's own)
#   --json PATH    where the JSON goes (default: $OUT/gpu_check.json, else ./gpu_check.json);
#                  gpu_check.log beside it holds every part's whole output
#   --budget S     the whole check ends within S seconds (default 450); a part's limit is cut
#                  to what is left, and a part with too little left is skipped
#
# Parts, in order, each under `timeout` with its own limit (a hang costs one part):
#   setup           the wheels and qarl, pip --no-index --no-deps --target, pip's config ignored
#   models          tiny, and random-init models of SmolLM2-135M's and Qwen2.5-0.5B's shapes
#   tests_gpu       pytest tests/gpu
#   parity          the learner-vs-sampler matrix of every scheme and alignment, on the device
#   train_kernel, train_fake   RL steps of the default recipe on the 135M shape: each step's
#                   mismatch and seconds per phase
#   step_time_135m, step_time_0.5b   seconds per RL step, every quantized scheme against bf16
# (benchmarks/gpu_parts.py says what each measures.) The JSON is written on every exit path
# (benchmarks/gpu_report.py assemble): each part's status, exit status, seconds, limit,
# output tail and figures, peak GPU memory, the carried wheels and their size. Exit status:
# 0 once the parts have run (their outcomes are in the JSON), 1 when the set-up fails, 2 when
# the machine is refused (no CUDA, torch too old). `benchmarks/gpu_report.py results FILE`
# writes a fetched JSON into docs/results.md.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"

DEVICE=cuda QUICK=0 PY=python3 WHEELS="" OUT_JSON="${OUT:-.}/gpu_check.json" BUDGET=""
ARGS="$*"
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --quick) QUICK=1; shift ;;
        --python) PY="$2"; shift 2 ;;
        --wheels) WHEELS="$2"; shift 2 ;;
        --json) OUT_JSON="$2"; shift 2 ;;
        --budget) BUDGET="$2"; shift 2 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
    esac
done
case "$OUT_JSON" in /*) ;; *) OUT_JSON="$ROOT/$OUT_JSON" ;; esac
SCALE=1  # the parts' limits below are for a GPU; a CPU dry run's parts take longer
if [ "$QUICK" = 1 ] && [ "$DEVICE" = cpu ]; then SCALE=2; fi
BUDGET="${BUDGET:-$(( 450 * SCALE ))}"
RESERVE=15  # seconds kept for writing the JSON
started=$(date +%s)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/qarl-gpu-check.XXXXXX")"
export PY WORK DEVICE
export SITE="$WORK/site" SRC="$WORK/src" MODELS="$WORK/models"
echo "$BUDGET" >"$WORK/budget"
echo "$ARGS" >"$WORK/args"
CHILD=""

note() { echo "[gpu_check $(( $(date +%s) - started ))s] $*" >&2; }
stop() { echo "$1" >"$WORK/status"; [ -n "${2:-}" ] && echo "$2" >"$WORK/reason"; }

finish() {
    local rc=$?
    [ -f "$WORK/status" ] || stop interrupted "the check stopped early (exit status $rc)"
    echo $(( $(date +%s) - started )) >"$WORK/wall"
    mkdir -p "$(dirname "$OUT_JSON")"
    if ! "$PY" benchmarks/gpu_report.py assemble --work "$WORK" --json "$OUT_JSON" \
            --log "$(dirname "$OUT_JSON")/gpu_check.log" 2>&1 | tail -20 >&2; then
        # no Python to write it with: the status and reason alone
        printf '{"benchmark": "gpu_check", "status": "%s", "reason": "%s", "parts": {}}\n' \
            "$(cat "$WORK/status")" "$(tr '"\\\n' "'/ " <"$WORK/reason" 2>/dev/null)" >"$OUT_JSON"
    fi
    note "wrote $OUT_JSON"
    rm -rf "$WORK"
}
trap finish EXIT
trap '[ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null; stop interrupted "SIGTERM"; exit 143' TERM
trap '[ -n "$CHILD" ] && kill -TERM "$CHILD" 2>/dev/null; stop interrupted "SIGINT"; exit 130' INT

# run_part NAME LIMIT_S COMMAND: COMMAND (a bash string) under its limit, cut to the budget left
run_part() {
    local name=$1 limit=$(( $2 * SCALE )) command=$3 left began
    echo "$name" >>"$WORK/parts"
    left=$(( BUDGET - ($(date +%s) - started) - RESERVE ))
    if [ "$left" -lt 20 ]; then
        echo "the check's budget (--budget $BUDGET s) was spent" >"$WORK/$name.skipped"
        note "$name: skipped, budget spent"; return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "$limit" >"$WORK/$name.limit"
    note "$name (limit $limit s)"
    began=$(date +%s.%N)
    timeout --kill-after=10 "$limit" bash -c "$command" >"$WORK/$name.log" 2>&1 &
    CHILD=$!
    wait "$CHILD"
    echo $? >"$WORK/$name.rc"
    CHILD=""
    awk -v a="$began" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f\n", b - a}' >"$WORK/$name.seconds"
    note "$name: exit $(cat "$WORK/$name.rc") after $(cat "$WORK/$name.seconds") s"
}

# skip_part NAME WHY: a part that cannot run because an earlier one did not give it its input
skip_part() { echo "$1" >>"$WORK/parts"; echo "$2" >"$WORK/$1.skipped"; note "$1: skipped, $2"; }

# --- the machine: its python3, its torch, its GPU; refused where they do not fit --------------
"$PY" benchmarks/gpu_report.py probe --device "$DEVICE" >"$WORK/probe.json" 2>"$WORK/probe.err"
case $? in
    0) ;;
    2) stop refused; exit 2 ;;  # the reason is in probe.json
    *) stop refused "$PY cannot run the probe: $(tail -c 600 "$WORK/probe.err")"; exit 2 ;;
esac
timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    >"$WORK/nvidia_smi" 2>/dev/null || rm -f "$WORK/nvidia_smi"

TAG="$("$PY" -c 'import json, sys; print(json.load(sys.stdin)["wheels_tag"])' <"$WORK/probe.json")"
WHEELS="${WHEELS:-.gpu-wheels/$TAG}"
case "$WHEELS" in /*) ;; *) WHEELS="$ROOT/$WHEELS" ;; esac
export WHEELS
if ! ls "$WHEELS"/*.whl "$WHEELS"/build/*.whl >/dev/null 2>&1; then
    version="${TAG#py}"
    stop setup_failed "no wheels in $WHEELS (and $WHEELS/build): on a machine that can download, \
run 'bash benchmarks/gpu_wheels.sh ${version%%-*} ${TAG##*-}' (this Python's version and \
machine) and carry .gpu-wheels with the checkout"
    exit 1
fi
for wheel in "$WHEELS"/*.whl "$WHEELS"/build/*.whl; do
    printf '{"name": "%s", "bytes": %s}\n' "${wheel#"$WHEELS"/}" "$(stat -c %s "$wheel")"
done >"$WORK/wheels"

# --- set-up: offline, into $SITE; pip's configuration files and index variables ignored ------
run_part setup 120 '
    set -e
    mkdir -p "$SRC" && cp -r pyproject.toml README.md qarl "$SRC"/
    env -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_FIND_LINKS -u PIP_CONSTRAINT \
        -u PIP_REQUIRE_VIRTUALENV PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 \
        PIP_DISABLE_PIP_VERSION_CHECK=1 \
        "$PY" -m pip install --no-index --no-deps --no-compile --find-links "$WHEELS/build" \
        --target "$SITE" "$WHEELS"/*.whl "$SRC"
    PYTHONPATH="$SITE" "$PY" benchmarks/gpu_report.py installed --site "$SITE" >"$WORK/setup.json"
    cat "$WORK/setup.json"'
if [ "$(cat "$WORK/setup.rc" 2>/dev/null)" != 0 ]; then
    stop setup_failed "the carried wheels and qarl did not install: see parts.setup"
    exit 1
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" QARL_HOME="$WORK/qarl_home"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
PARTS='"$PY" benchmarks/gpu_parts.py'

# --- the parts ----------------------------------------------------------------------------------
SMALL="$MODELS/smollm2-135m-shape" LARGE="$MODELS/qwen2.5-0.5b-shape" STEPS=3
if [ "$QUICK" = 1 ]; then SMALL=tiny STEPS=2; fi
export SMALL LARGE STEPS
QUICK_FLAG=$([ "$QUICK" = 1 ] && echo --quick)
export QUICK_FLAG

run_part models 150 "$PARTS"' models --out "$MODELS" --device "$DEVICE" $QUICK_FLAG --json "$WORK/models.json"'
run_part tests_gpu 150 '"$PY" -m pytest -q tests/gpu -m "gpu or not gpu" -rs -p no:cacheprovider'
run_part parity 120 "$PARTS"' parity --model tiny --device "$DEVICE" $QUICK_FLAG --json "$WORK/parity.json"'
for align in kernel fake; do
    if [ "$QUICK" = 0 ] && [ ! -f "$SMALL/config.json" ]; then
        skip_part "train_$align" "the 135M-shape model was not built (part models)"; continue
    fi
    run_part "train_$align" 100 "$PARTS"' train --model "$SMALL" --align '"$align"' --device "$DEVICE" \
        --steps "$STEPS" --json "$WORK/train_'"$align"'.json"'
done
if [ "$QUICK" = 1 ]; then
    run_part step_time_tiny 150 "$PARTS"' step-time --model tiny --arms none,w8a8-int8 --steps 2 \
        --device "$DEVICE" --json "$WORK/step_time_tiny.json"'
else
    for size in 135m 0.5b; do
        model=$([ "$size" = 135m ] && echo "$SMALL" || echo "$LARGE")
        if [ ! -f "$model/config.json" ]; then
            skip_part "step_time_$size" "the $size-shape model was not built (part models)"; continue
        fi
        run_part "step_time_$size" 200 "$PARTS"' step-time --model "'"$model"'" --steps "$STEPS" \
            --device "$DEVICE" --json "$WORK/step_time_'"$size"'.json"'
    done
fi
stop ran
exit 0
