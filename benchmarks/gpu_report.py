"""benchmarks/gpu_check.sh's helpers that must run before qarl is installed, and after: the
standard library only at import (torch is imported inside `probe`, qarl inside `installed`).

    python3 benchmarks/gpu_report.py probe --device cuda    # JSON; exit 2: refused, and why
    python3 benchmarks/gpu_report.py installed --site DIR   # where each carried module loads from
    python3 benchmarks/gpu_report.py assemble --work DIR --json OUT [--log LOG]
    .venv/bin/python benchmarks/gpu_report.py results gpu_check.json   # into docs/results.md

`assemble` writes the check's one JSON file from the folder its parts left (see gpu_check.sh):
each part's status (ok, failed, timeout, skipped, interrupted), exit status, seconds, time
limit, output tail and figures. `results` writes a fetched gpu_check.json into the results
page: the parts' summary always, and on CUDA the parity matrix, the RL steps and the step
times (the machine class and date are the run's, from the file).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

MIN_TORCH = (2, 9)  # pyproject.toml's torch>=2.9
TAIL = 3000  # characters of each part's output kept in the JSON
CARRIED = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection",
           "typing_extensions", "gguf", "math_verify", "latex2sympy2_extended", "antlr4")


def python_tag() -> str:
    """The wheels folder this interpreter takes: benchmarks/gpu_wheels.sh's naming."""
    return f"py{sys.version_info.major}.{sys.version_info.minor}-{platform.machine()}"


def probe(device: str) -> tuple[dict, str | None]:
    """This interpreter, its torch and GPU; and why the check refuses to run, or None."""
    found = {"python": platform.python_version(), "executable": sys.executable,
             "wheels_tag": python_tag(), "device": device}
    try:
        import torch
    except ImportError as exc:
        return found, (f"{sys.executable} cannot import torch ({exc}); run the check with the "
                       "Python that holds the machine's CUDA build of torch (--python)")
    found.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                 cuda_available=torch.cuda.is_available())
    version = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if version < MIN_TORCH:
        return found, (f"torch {torch.__version__} is older than qarl's torch>="
                       f"{'.'.join(map(str, MIN_TORCH))}")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            why = ("this torch is a CPU build" if torch.version.cuda is None
                   else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES)")
            return found, (f"--device {device}, but {why} (torch {torch.__version__}); run on a "
                           "GPU machine with a CUDA build of torch, or dry-run with --device cpu")
        found["gpu"] = {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
                        "capability": list(torch.cuda.get_device_capability(0)),
                        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
    return found, None


def installed(site: Path) -> tuple[dict, list[str]]:
    """Each carried module's and qarl's version and file; the carried ones not from `site`."""
    import importlib
    import importlib.metadata

    found, stray = {}, []
    for name in (*CARRIED, "qarl"):
        module = importlib.import_module(name)
        where = Path(module.__file__).resolve()
        found[name] = str(where)
        if name in CARRIED and not where.is_relative_to(site.resolve()):
            stray.append(f"{name} from {where}")
    found["qarl_version"] = importlib.metadata.version("qarl")
    return found, stray


# ---- assemble ------------------------------------------------------------------------------


def read(path: Path, default: str | None = None) -> str | None:
    return path.read_text(errors="replace").strip() if path.exists() else default


def part_record(work: Path, name: str) -> dict:
    rc, skipped = read(work / f"{name}.rc"), read(work / f"{name}.skipped")
    if skipped is not None:
        status = "skipped"
    elif rc is None:
        status = "interrupted"  # started, and the check ended before it did
    else:
        status = {"0": "ok", "124": "timeout", "137": "timeout"}.get(rc, "failed")
    figures = None
    if (work / f"{name}.json").exists():
        try:
            figures = json.loads((work / f"{name}.json").read_text())
        except ValueError as exc:
            figures = {"unreadable": str(exc)}
    log, seconds, limit = (read(work / f"{name}.{kind}") for kind in ("log", "seconds", "limit"))
    return {"status": status, "rc": None if rc is None else int(rc), "skipped": skipped,
            "seconds": None if seconds is None else float(seconds),  # None: never ran
            "limit_s": None if limit is None else int(limit), "tail": (log or "")[-TAIL:],
            "figures": figures}


def peak(parts: dict, key: str) -> float | None:
    values = [p["figures"].get(key) for p in parts.values() if isinstance(p["figures"], dict)]
    values = [v for v in values if isinstance(v, (int, float))]
    return max(values) if values else None


def assemble(work: Path, out: Path, log: Path | None) -> dict:
    names = (read(work / "parts", "") or "").split()
    parts = {name: part_record(work, name) for name in names}
    wheels = [json.loads(line) for line in (read(work / "wheels", "") or "").splitlines()]
    found = json.loads(read(work / "probe.json", "{}") or "{}")
    report = {
        "benchmark": "gpu_check",
        "status": read(work / "status", "interrupted"),
        "reason": read(work / "reason") or found.get("refused"),
        "date": datetime.date.today().isoformat(),
        "args": read(work / "args", ""),
        "probe": found,
        "nvidia_smi": read(work / "nvidia_smi"),
        "wheels": {"files": wheels, "total_mib": round(sum(w["bytes"] for w in wheels) / 2**20, 2)},
        "wall_s": int(read(work / "wall", "0") or 0),
        "budget_s": int(read(work / "budget", "0") or 0),
        "peak_gpu_allocated_gib": peak(parts, "peak_gpu_allocated_gib"),
        "peak_gpu_reserved_gib": peak(parts, "peak_gpu_reserved_gib"),
        "parts": parts,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    if log is not None:  # every part's whole output, for a failure the tail does not explain
        with log.open("w") as sink:
            for name in names:
                sink.write(f"===== {name} ({parts[name]['status']})\n{read(work / f'{name}.log', '')}\n")
    return report


def summary(report: dict) -> str:
    lines = [f"gpu_check: {report['status']}" + (f" ({report['reason']})" if report["reason"] else "")
             + f", {report['wall_s']} s, carried wheels {report['wheels']['total_mib']} MiB"]
    lines += [f"  {name:<22} {p['status']:<11} {p['seconds'] or 0:7.1f} s of {p['limit_s'] or 0}"
              for name, p in report["parts"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("probe").add_argument("--device", default="cuda")
    sub.add_parser("installed").add_argument("--site", type=Path, required=True)
    p = sub.add_parser("assemble")
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--log", type=Path, default=None)
    sub.add_parser("results").add_argument("report", type=Path)
    args = parser.parse_args()
    if args.command == "probe":
        found, refused = probe(args.device)
        print(json.dumps({**found, "refused": refused}))
        sys.exit(2 if refused else 0)
    if args.command == "installed":
        found, stray = installed(args.site)
        print(json.dumps(found, indent=1))
        if stray:
            sys.exit(f"carried modules loaded from outside {args.site}: {stray}")
    if args.command == "assemble":
        print(summary(assemble(args.work, args.json, args.log)), file=sys.stderr)
    if args.command == "results":
        from gpu_results import write_results

        write_results(json.loads(args.report.read_text()))


if __name__ == "__main__":
    main()
