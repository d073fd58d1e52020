#!/usr/bin/env bash
# The wheels an air-gapped GPU machine needs to install qarl, fetched on a machine that can
# download; benchmarks/gpu_check.sh installs them there with --no-index (docs/install.md).
#
#     bash benchmarks/gpu_wheels.sh                 # Python 3.12, x86_64: .gpu-wheels/py3.12-x86_64/
#     bash benchmarks/gpu_wheels.sh 3.11            # another Python (the CPU dry run uses this one's)
#     bash benchmarks/gpu_wheels.sh 3.12 aarch64 DIR
#
# A CUDA PyTorch image already holds torch, transformers (with tokenizers, huggingface-hub,
# safetensors, pyyaml, tqdm), requests, numpy, sympy, matplotlib, pyarrow, peft and pytest.
# qarl needs these beyond them, each pinned, fetched without dependencies (--no-deps) so that
# the folder holds exactly this list:
#
#   pydantic, pydantic-core, annotated-types, typing-inspection   qarl.config (pydantic-core is
#                                                                  the only compiled wheel)
#   typing-extensions      pydantic needs a newer one than an image may hold; it shadows the
#                          image's only inside the check's target folder
#   gguf                   qarl.model reads GGUF files (imported by qarl.model.loading)
#   math-verify, latex2sympy2-extended, antlr4-python3-runtime     the math tasks' reward
#   setuptools             only to build qarl's own wheel offline (pip's build isolation finds
#                          it in this folder); never installed into the target
#
# The folder is replaced on each run (one version of each wheel: two stop an install) and the
# total size is printed last. `.gpu-wheels/` is ignored by git: carry it with the checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${1:-3.12}"
ARCH="${2:-x86_64}"
DEST="${3:-.gpu-wheels/py$PY_VERSION-$ARCH}"
PYTHON="${PYTHON:-python3}"

RUNTIME=(
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0
    gguf==0.19.0
    math-verify==0.9.0 latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2
)
BUILD=(setuptools==84.2.1)

# pip matches a manylinux tag exactly: offer the glibc levels wheels are commonly built for
PLATFORMS=(--platform "manylinux2014_$ARCH")
for glibc in 17 24 27 28 31 34 35 39; do
    PLATFORMS+=(--platform "manylinux_2_${glibc}_$ARCH")
done

rm -rf "$DEST"
mkdir -p "$DEST/build"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST" "${RUNTIME[@]}"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" \
    --implementation cp "${PLATFORMS[@]}" -d "$DEST/build" "${BUILD[@]}"

ls -l "$DEST"/*.whl "$DEST"/build/*.whl | awk '{print $5, $NF}'
du -cb "$DEST"/*.whl "$DEST"/build/*.whl \
    | awk -v dest="$DEST" 'END {printf "%s: %.1f MiB in all\n", dest, $1 / 1048576}'
