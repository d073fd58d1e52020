"""benchmarks/gpu_report.py and gpu_results.py: the GPU check's JSON from the files its parts
leave (a part's status from its exit status, its limit, its skip), and the results page's
sections from that JSON, with the run's machine class and date (not this machine's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_report  # noqa: E402
import gpu_results  # noqa: E402
import results_page  # noqa: E402

GPU = {"name": "NVIDIA H100 80GB HBM3", "count": 1, "capability": [9, 0], "memory_gib": 79.2}


def test_part_status_follows_exit_status_skip_and_absence(tmp_path):
    """rc 0: ok; 124 or 137 (timeout's): timeout; other: failed; a skip file: skipped; started
    without an rc (the check ended first): interrupted. The figures and the tail come along."""
    for name, rc in (("a", "0"), ("b", "124"), ("c", "137"), ("d", "1")):
        (tmp_path / f"{name}.rc").write_text(rc + "\n")
    (tmp_path / "e.skipped").write_text("the check's budget was spent\n")
    (tmp_path / "a.json").write_text(json.dumps({"peak_gpu_allocated_gib": 3.5}))
    (tmp_path / "a.log").write_text("x" * 5000 + "end")
    (tmp_path / "a.limit").write_text("120\n")
    (tmp_path / "a.seconds").write_text("12.5\n")
    statuses = {n: gpu_report.part_record(tmp_path, n)["status"] for n in "abcdef"}
    assert statuses == {"a": "ok", "b": "timeout", "c": "timeout", "d": "failed",
                        "e": "skipped", "f": "interrupted"}
    a = gpu_report.part_record(tmp_path, "a")
    assert a["tail"].endswith("end") and len(a["tail"]) == gpu_report.TAIL
    assert (a["limit_s"], a["seconds"], a["figures"]) == (120, 12.5, {"peak_gpu_allocated_gib": 3.5})


def test_assemble_reports_parts_in_order_wheels_and_peak_memory(tmp_path):
    """The JSON lists the parts in the order they ran, the wheels' total size, the largest
    peak GPU memory of any part, and a refusal's reason from the probe."""
    (tmp_path / "parts").write_text("setup\nparity\n")
    for name, peak in (("setup", None), ("parity", 2.25)):
        (tmp_path / f"{name}.rc").write_text("0")
        (tmp_path / f"{name}.json").write_text(json.dumps({"peak_gpu_allocated_gib": peak}))
    (tmp_path / "wheels").write_text('{"name": "a.whl", "bytes": 1048576}\n'
                                     '{"name": "build/b.whl", "bytes": 524288}\n')
    (tmp_path / "status").write_text("refused")
    (tmp_path / "probe.json").write_text(json.dumps({"refused": "no CUDA here"}))
    report = gpu_report.assemble(tmp_path, tmp_path / "out" / "gpu_check.json", None)
    assert list(report["parts"]) == ["setup", "parity"]
    assert report["wheels"]["total_mib"] == 1.5 and report["peak_gpu_allocated_gib"] == 2.25
    assert report["reason"] == "no CUDA here"
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text()) == report


def cuda_report() -> dict:
    row = {"scheme": "w8a8-int8", "align": "kernel", "engine": "local", "path": "decode-replay",
           "mean_abs_dlogp": 0.0, "bit_exact": True}
    arm = {"step": 2.0, **dict.fromkeys(gpu_results.PHASES, 0.1), "peak_gpu_allocated_gib": 4.0}
    step = {"step": 1, "mismatch/abs_diff_max": 0.0, "mismatch/abs_diff_mean": 0.0,
            **{f"time/{p}": 0.1 for p in gpu_results.PHASES}}
    part = {"status": "ok", "seconds": 1.0, "limit_s": 60}
    return {
        "status": "ran", "date": "2026-01-02", "args": "", "wall_s": 300, "budget_s": 450,
        "probe": {"torch": "2.11.0+cu130", "python": "3.12.3", "gpu": GPU},
        "wheels": {"files": [{"name": "a.whl", "bytes": 1}], "total_mib": 4.0},
        "peak_gpu_allocated_gib": 4.0,
        "parts": {
            "parity": {**part, "figures": {"rows": [row], "prompts": 16, "max_new_tokens": 24}},
            "train_kernel": {**part, "figures": {"steps": [step],
                                                 "overrides": {"model.name": "/t/m-shape"}}},
            "step_time_0.5b": {**part, "figures": {"model": "/t/qwen2.5-0.5b-shape", "arms": {
                "bf16": {**arm, "speed_vs_bf16": 1.0},
                "w8a8-int8": {**arm, "step": 1.0, "speed_vs_bf16": 2.0}}}},
        },
    }


@pytest.fixture
def page(tmp_path, monkeypatch) -> Path:
    monkeypatch.setattr(results_page, "RESULTS", tmp_path / "results.md")
    monkeypatch.setattr(results_page, "README", tmp_path / "README.md")  # absent: not synced
    return tmp_path / "results.md"


def test_cuda_run_writes_its_sections_with_its_machine_and_date(page):
    """A CUDA run writes the parts, parity, RL-step and step-time sections, each naming the
    run's GPU and date, and glance rows for parity and w8a8-int8 against bf16."""
    gpu_results.write_results(cuda_report())
    text = page.read_text()
    sections = results_page.sections(text)
    assert list(sections) == ["gpu-check", "gpu-parity", "gpu-train", "gpu-step-time"]
    machine = "CUDA: NVIDIA H100 80GB HBM3; torch 2.11.0+cu130, Python 3.12.3"
    assert all(machine in body and "2026-01-02" in body for body in sections.values())
    assert "bit for bit in 1 of 1 schemes" in text
    assert "0.50x the time (1.00 s vs 2.00 s)" in text and "4.00 GiB" in text


def test_cpu_dry_run_writes_the_parts_section_only(page):
    """A dry run (no GPU in its probe) writes `gpu-check` alone, no glance."""
    report = cuda_report()
    report["probe"] = {"torch": "2.13.0+cpu", "python": "3.11.7", "wheels_tag": "py3.11-x86_64"}
    gpu_results.write_results(report)
    sections = results_page.sections(page.read_text())
    assert list(sections) == ["gpu-check"]
    assert "CPU dry run (py3.11-x86_64)" in sections["gpu-check"]
    assert "<!-- glance" not in sections["gpu-check"] and "4.0 MiB" in sections["gpu-check"]
