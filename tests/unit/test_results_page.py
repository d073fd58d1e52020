"""benchmarks/results_page.py: docs/results.md's sections written in place, its glance table
rebuilt from them, README.md's copy of it, and a machine class that names no CPU model."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import results_page  # noqa: E402

from qarl.native.isa import cpu_name, isa_levels  # noqa: E402

DATE, MACHINE = "2025-01-02", "x86-64 AMD, AVX2, no AVX-512; 2 cores; torch 2.13.0, 2 threads"
TABLE = "| a | b |\n|---|---|\n| 1 | 2 |"


@pytest.fixture
def files(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """(page, README) where results_page reads and writes: a page not written yet (the first
    write creates it) and a copy of the repository's README."""
    page, readme = tmp_path / "docs" / "results.md", tmp_path / "README.md"
    page.parent.mkdir()
    shutil.copy(ROOT / "README.md", readme)
    monkeypatch.setattr(results_page, "RESULTS", page)
    monkeypatch.setattr(results_page, "README", readme)
    return page, readme


def write(key: str, table: str = TABLE, glance=None, **kwargs) -> None:
    results_page.write_section(key, f"Section {key}", f"python benchmarks/{key}.py --results",
                               table, glance=glance, machine=MACHINE, date=DATE, **kwargs)


def block(text: str, first: str, last: str) -> str:
    return text.split(first, 1)[1].split(last, 1)[0].strip("\n")


def outside_markers(text: str) -> str:
    return re.sub(r"<!-- results:([a-z0-9._-]+):begin -->.*?<!-- results:\1:end -->", "<>",
                  text, flags=re.S)


def test_a_new_section_is_appended_and_an_old_one_replaced_in_place(files):
    """Keys a, b, c are appended in that order; writing b again changes b's text only, in
    b's place, and the section holds its heading, command · machine · date line, table and
    notes."""
    page, _ = files
    for key in "abc":
        write(key)
    before = results_page.sections(page.read_text())
    write("b", table="| x |\n|---|\n| 9 |", notes="x: the new column.")
    after = results_page.sections(page.read_text())
    assert list(after) == ["a", "b", "c"]
    assert after["a"] == before["a"] and after["c"] == before["c"]
    assert after["b"] == ("## Section b\n\n`python benchmarks/b.py --results` · "
                          f"{MACHINE} · {DATE}\n\n| x |\n|---|\n| 9 |\n\nx: the new column.")


def test_the_glance_table_is_rebuilt_from_every_section(files):
    """The page's glance block has one row per section with a glance, in page order, linking
    to the section's heading; replacing a section's glance replaces its row."""
    page, _ = files
    write("a", glance=("qarl vs TRL", "3.5x"))
    write("b")
    write("c", glance=("step | time", "1.2x"))
    write("a", glance=("qarl vs TRL", "4.0x"))
    glance = block(page.read_text(), "<!-- results:glance:begin -->", "<!-- results:glance:end -->")
    assert glance.splitlines() == [
        "| what | reading | machine class | date |", "|---|---|---|---|",
        f"| [qarl vs TRL](#section-a) | 4.0x | {MACHINE} | {DATE} |",
        f"| [step \\| time](#section-c) | 1.2x | {MACHINE} | {DATE} |"]


def test_the_readme_block_is_the_glance_table_and_nothing_else_changes(files):
    """After a write, README.md's results block holds exactly the page's glance table with
    links into docs/results.md; every README line outside the block is as it was."""
    page, readme = files
    original = readme.read_text()
    write("a", glance=("qarl vs TRL", "3.5x"))
    text = readme.read_text()
    shown = block(text, results_page.README_BEGIN, results_page.README_END)
    assert shown == results_page.glance_table(page.read_text(), "docs/results.md")
    assert "](docs/results.md#section-a)" in shown
    head = original.split(results_page.README_BEGIN)[0]
    tail = original.split(results_page.README_END)[1]
    assert text.startswith(head + results_page.README_BEGIN + "\n")
    assert text.endswith(results_page.README_END + tail)


def test_text_outside_the_markers_is_left_as_it_was(files):
    """The page's header and any text between sections survive every rewrite unchanged."""
    page, _ = files
    write("a")
    page.write_text(page.read_text() + "\nA line between sections.\n")
    write("b")
    outside = outside_markers(page.read_text())
    write("a", glance=("what", "reading"), notes="notes")
    write("b", table="| y |\n|---|\n| 0 |")
    assert outside_markers(page.read_text()) == outside
    assert page.read_text().startswith(results_page.HEADER)


def test_a_readme_without_the_block_is_refused_by_sync_and_left_alone_by_writes(files):
    """sync_readme() names the two markers to add; write_section writes the page and leaves
    such a README untouched."""
    page, readme = files
    readme.write_text("# qarl\n\nNo results here.\n")
    write("a", glance=("what", "reading"))
    assert readme.read_text() == "# qarl\n\nNo results here.\n"
    assert "a" in results_page.sections(page.read_text())
    with pytest.raises(SystemExit, match=re.escape(results_page.README_BEGIN)) as raised:
        results_page.sync_readme()
    assert results_page.README_END in str(raised.value)
    assert readme.read_text() == "# qarl\n\nNo results here.\n"


def test_a_missing_page_is_created_with_its_header(files):
    """A page that does not exist yet starts with the fixed header and the glance block."""
    page, _ = files
    assert not page.exists()
    write("a", glance=("what", "reading"))
    text = page.read_text()
    assert text.startswith(results_page.HEADER + "\n<!-- results:glance:begin -->\n| what |")
    assert list(results_page.sections(text)) == ["a"]


def test_machine_class_names_no_cpu_model():
    """This machine's class names neither lscpu's model name nor a family / model number,
    and names its instruction-set levels and cores."""
    text = results_page.machine_class()
    assert cpu_name() not in text
    assert "family" not in text.lower() and "model" not in text.lower()
    count = results_page.cores()
    assert f"; {count} core{'s' if count > 1 else ''};" in text
    if "x86-64" in text:
        assert results_page.isa_class(isa_levels()) in text


def test_machine_class_counts_in_the_singular_for_one(monkeypatch):
    """One core and one thread read '1 core' and '1 thread'; two read '2 cores', '2 threads'."""
    import torch

    for n, core, thread in ((1, "1 core;", "1 thread"), (2, "2 cores;", "2 threads")):
        monkeypatch.setattr(results_page, "cores", lambda n=n: n)
        monkeypatch.setattr(torch, "get_num_threads", lambda n=n: n)
        text = results_page.machine_class()
        assert core in text and text.endswith(f", {thread}")


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "fma"}, "AVX2, no AVX-512"),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"},
     "AVX-512 + VNNI + AVX512-BF16, no AMX"),
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile",
      "amx_bf16", "amx_int8"}, "AVX-512 + VNNI + AVX512-BF16 + AMX-BF16 + AMX-INT8"),
    (set(), "no AVX2"),
])
def test_isa_class_names_the_levels_and_the_next_one_missing(flags, expected):
    """Each kind of machine's instruction sets, in the page's words."""
    assert results_page.isa_class(isa_levels(flags)) == expected


def test_the_repository_page_and_readme_agree():
    """docs/results.md starts with its header and has its glance block; README.md's results
    block is that glance table, so the README's results come from the page."""
    page = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert page.startswith(results_page.HEADER)
    assert "<!-- results:glance:begin -->" in page and "<!-- results:glance:end -->" in page
    shown = block(readme, results_page.README_BEGIN, results_page.README_END)
    assert shown == results_page.glance_table(page, "docs/results.md")
