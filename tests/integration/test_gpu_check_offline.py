"""benchmarks/gpu_check.sh's air-gapped path, dry-run on this CPU (docs/install.md).

The GPU machine's image holds torch and a few libraries, not pydantic, gguf or math-verify, and
reaches no index. Here that image is emulated honestly: a fresh virtual environment of the base
interpreter (none of .venv's packages) whose only other packages are links to the image's
libraries and their dependency closure, taken from the installed torch, transformers, ...
(`image_env`). The check then sees those, the wheels benchmarks/gpu_wheels.sh fetched, and
nothing else: its pip runs with --no-index and no configuration. A copy of .venv with
--system-site-packages would see every package qarl needs, and prove nothing.

The slow tests fetch the wheels once (the package index is needed for that step only) and
run the whole check with `--device cpu --quick`; the fast ones check its refusals.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "gpu_check.sh"
# What a CUDA PyTorch image holds (the GPU machine's, docs/install.md), and what it lacks
IMAGE = ("torch", "transformers", "safetensors", "tokenizers", "numpy", "matplotlib", "pyarrow",
         "peft", "pytest", "requests", "pip")
ABSENT = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "gguf",
          "math-verify", "latex2sympy2-extended", "antlr4-python3-runtime", "qarl")
CARRIED = {"pydantic", "pydantic_core", "annotated_types", "typing_inspection",
           "typing_extensions", "gguf", "math_verify", "latex2sympy2_extended",
           "antlr4_python3_runtime", "setuptools"}
TAG = f"py{sys.version_info.major}.{sys.version_info.minor}-{platform.machine()}"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(names, leave_out) -> set[str]:
    """The installed distributions `names` need, themselves included (markers evaluated here,
    no extras), without `leave_out` and what only they need."""
    seen, todo, leave_out = set(), [canonical(n) for n in names], {canonical(n) for n in leave_out}
    while todo:
        name = todo.pop()
        if name in seen or name in leave_out:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional or other-platform requirement that is not installed
        seen.add(name)
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonical(req.name))
    return seen


def image_env(folder: Path) -> Path:
    """A fresh environment that sees the IMAGE packages and their closure but ABSENT, and
    nothing else: -> its python. (Here huggingface-hub's typer asks for pydantic; the GPU
    image's typer does not, and the image has no pydantic: ABSENT is left out of the closure.)"""
    dists = closure(IMAGE, leave_out=ABSENT)
    site = folder / "image-site"
    site.mkdir(parents=True)
    for name in sorted(dists):
        dist = importlib.metadata.distribution(name)
        base = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            if not (site / top).exists() and (base / top).exists():
                (site / top).symlink_to(base / top)
    env = folder / "env"
    venv.create(env, with_pip=False, symlinks=True)
    python = env / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "image.pth").write_text(f"import site; site.addsitedir({str(site)!r})\n")
    return python


# A proxy that refuses every connection: pip, huggingface-hub and requests honour these, so a
# part that reached for the network would fail instead of quietly downloading.
NO_NETWORK = dict.fromkeys(("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"),
                           "http://127.0.0.1:9")


def clean_environ(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "QARL_HOME", "NO_PROXY", "no_proxy")}
    return {**env, **NO_NETWORK, "TMPDIR": str(tmp)}


def run_check(tmp: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp / "out" / "gpu_check.json"
    done = subprocess.run(["bash", str(CHECK), *args, "--json", str(out)], cwd=ROOT,
                          env=clean_environ(tmp), capture_output=True, text=True,
                          timeout=timeout)
    return done, json.loads(out.read_text())


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """(tmp folder, the image's python, the wheels folder): the wheels fetched for this
    interpreter by benchmarks/gpu_wheels.sh, the image emulated."""
    tmp = tmp_path_factory.mktemp("offline")
    wheels = tmp / "wheels" / TAG
    fetched = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_wheels.sh"), f"{sys.version_info.major}."
         f"{sys.version_info.minor}", platform.machine(), str(wheels)],
        env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=600)
    assert fetched.returncode == 0, f"benchmarks/gpu_wheels.sh failed (it needs the package " \
                                    f"index):\n{fetched.stderr[-3000:]}"
    python = image_env(tmp / "image")
    return tmp, python, wheels


@pytest.mark.slow
def test_the_emulated_image_has_torch_and_lacks_what_the_wheels_carry(offline):
    """The fresh environment imports torch and transformers, and none of the carried modules
    but typing_extensions (torch needs one; the carried one is newer)."""
    _, python, _ = offline
    probe = ("import importlib.util as u; import torch, transformers; "
             "print([m for m in ('pydantic', 'gguf', 'math_verify', 'antlr4', 'qarl') "
             "if u.find_spec(m)])")
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, cwd="/")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.slow
def test_dry_run_installs_offline_and_runs_every_part(offline):
    """`gpu_check.sh --device cpu --quick` in the emulated image: the wheels and qarl install
    with no index, every part runs to exit 0 within the budget, the carried modules and qarl
    load from the check's target folder, and the figures hold what the CPU promises: kernel
    alignment bit exact in every scheme's parity row and every RL step, fake alignment not."""
    tmp, python, wheels = offline
    done, report = run_check(tmp, "--device", "cpu", "--quick", "--python", str(python),
                             "--wheels", str(wheels), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    parts = report["parts"]
    assert report["status"] == "ran" and report["wall_s"] <= report["budget_s"]
    assert {name: p["status"] for name, p in parts.items()} == dict.fromkeys(
        ["setup", "models", "tests_gpu", "parity", "train_kernel", "train_fake",
         "step_time_tiny"], "ok"), {n: p["tail"][-1500:] for n, p in parts.items()}
    names = {re.split(r"-\d", w["name"].removeprefix("build/"))[0] for w in report["wheels"]["files"]}
    assert names == CARRIED and report["wheels"]["total_mib"] < 30
    site = Path(parts["setup"]["figures"]["qarl"]).parents[1]
    assert site.name == "site" and not site.is_relative_to(ROOT)
    parity = parts["parity"]["figures"]
    assert not parity["errors"]
    kernel = [c for c in parity["cells"] if c["align"] == "kernel" and c["path"] == "decode-replay"]
    assert len(kernel) == 6 and all(c["bit_exact"] for c in kernel)
    for align, exact in (("kernel", True), ("fake", False)):
        steps = parts[f"train_{align}"]["figures"]["steps"]
        assert len(steps) == 2 and all(s["time/update"] > 0 for s in steps)
        assert all((s["mismatch/abs_diff_max"] == 0) == exact for s in steps)
    arms = parts["step_time_tiny"]["figures"]["arms"]
    assert set(arms) == {"none", "w8a8-int8"} and all(a["step"] > 0 for a in arms.values())


@pytest.mark.slow
def test_a_short_budget_cuts_parts_and_still_writes_the_json(offline):
    """With --budget 60 (the dry run takes longer) the check ends within the budget plus its
    kill grace, each part ok, timed out or skipped, at least one not ok, and the JSON says so."""
    tmp, python, wheels = offline
    done, report = run_check(tmp, "--device", "cpu", "--quick", "--python", str(python),
                             "--wheels", str(wheels), "--budget", "60", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    statuses = {p["status"] for p in report["parts"].values()}
    assert statuses <= {"ok", "timeout", "skipped"} and statuses - {"ok"}
    assert report["wall_s"] <= 60 + 10


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
def test_a_torch_without_cuda_is_refused_in_the_json(tmp_path):
    """The default --device cuda on a CPU build of torch: exit 2, and the JSON's reason names
    the build and the way to dry-run instead."""
    done, report = run_check(tmp_path, "--python", sys.executable, timeout=120)
    assert done.returncode == 2
    assert report["status"] == "refused" and report["parts"] == {}
    assert "this torch is a CPU build" in report["reason"] and "--device cpu" in report["reason"]


def test_missing_wheels_fail_the_setup_naming_the_fetch_command(tmp_path):
    """No carried wheels: exit 1 before any install, the reason names gpu_wheels.sh with this
    Python's version and machine."""
    done, report = run_check(tmp_path, "--device", "cpu", "--python", sys.executable,
                             "--wheels", str(tmp_path / "none"), timeout=120)
    assert done.returncode == 1
    assert report["status"] == "setup_failed"
    assert f"bash benchmarks/gpu_wheels.sh {TAG.removeprefix('py').replace('-', ' ')}" in report["reason"]
