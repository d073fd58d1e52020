"""The README and the docs are reference, not a diary: no commit ids and no CPU model names
outside docs/history/ and the generated results page, in the README, docs/ or the package's
code, recipes and READMEs; the README at most 250 lines."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_LINES = 250

# A commit id as people quote one: 7 to 12 hex digits with at least one letter and one digit,
# not part of a longer word or of a number ("0.693359375f" in a C constant is not one).
COMMIT = re.compile(r"(?<![\w.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}(?!\w)")
# CPU models and hosts as lscpu or a vendor names them; a machine *class* is said by its
# instruction sets (AVX2, AVX-512, VNNI, AMX), which these do not match.
CPU = re.compile(r"\b(Zen ?\d|EPYC|Xeon|Ryzen|Threadripper|Opteron|Core\(TM\)|Intel\(R\)|"
                 r"Genoa|Milan|Sapphire Rapids|Emerald Rapids|Granite Rapids|Ice Lake|"
                 r"Cascade Lake|Skylake|family \d+ model \d+)\b")


def violations(text: str) -> list[str]:
    """'line N: token' for every commit-id-shaped token and CPU model name in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        found += [f"line {number}: {m.group(0)}" for m in COMMIT.finditer(line)]
        found += [f"line {number}: {m.group(0)}" for m in CPU.finditer(line)]
    return found


def checked_files() -> list[Path]:
    """README.md, docs/ but its history and the generated results page, and the package's
    code, recipes and READMEs."""
    docs = [p for p in (ROOT / "docs").rglob("*.md")
            if "history" not in p.relative_to(ROOT / "docs").parts and p.name != "results.md"]
    package = [p for suffix in ("*.py", "*.c", "*.h", "*.toml", "*.md")
               for p in (ROOT / "qarl").rglob(suffix)]
    return [ROOT / "README.md", *docs, *package]


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_commit_id_or_cpu_model_outside_the_history(path):
    """Dated readings and their provenance live in docs/history/; a figure's one home is
    docs/results.md, written by the benchmark that measures it."""
    found = violations(path.read_text(encoding="utf-8"))
    assert not found, f"{path.relative_to(ROOT)}: {found[:8]} (move them to docs/history/)"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(markdown: Path) -> set[str]:
    """The anchors GitHub gives the headings of a markdown file."""
    headings = re.findall(r"^#+ (.*)$", markdown.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def reference_pages() -> list[Path]:
    return [p for p in checked_files() if p.suffix == ".md"]


@pytest.mark.parametrize("page", reference_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_pages_resolve(page):
    """Every relative link of a reference page names a file that exists, and an anchor that
    its headings give."""
    broken = []
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_readme_is_reference_sized():
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= README_LINES, f"README.md has {lines} lines, at most {README_LINES}"


def test_a_planted_commit_id_or_cpu_name_is_caught():
    """The check catches this repository's own commit ids and the CPU names lscpu prints, and
    leaves numbers, hex constants and instruction-set names alone."""
    # the newest commit id with a letter in its 7-character form (an id of digits alone
    # reads as a number, which the check leaves alone on purpose)
    log = subprocess.run(["git", "log", "--format=%h", "--abbrev=7", "-n", "50"], cwd=ROOT,
                         capture_output=True, text=True)
    ids = [i for i in log.stdout.split() if re.search("[a-f]", i)] if log.returncode == 0 else []
    planted = ids[:1]
    for text in planted + ["measured at 1fc98a5 on", "(e6573bc, d9a303c)", "commit 4770f19a2b"]:
        assert violations(f"a sentence {text} here"), text
    for name in ("2 AMD EPYC Zen 4 cores", "an Intel Xeon", "Intel(R) Xeon(R) Platinum",
                 "family 25 model 17"):
        assert violations(name), name
    for fine in ("1.5e-06 nats", "0.693359375f", "0x1023", "1234567 rows", "deadbeef",
                 "AVX-512 VNNI and AMX-INT8", "sha256 below", "abcdefgh"):
        assert not violations(fine), fine
