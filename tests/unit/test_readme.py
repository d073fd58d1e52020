"""The README's error-output example is what the command it shows prints, character for
character, so editing either side fails this test."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from qarl.cli import main

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- readme-error-example:"


def readme_example() -> tuple[list[str], str]:
    """(the command's arguments after `qarl`, its expected output) from the fenced block that
    follows MARKER in README.md."""
    text = (ROOT / "README.md").read_text()
    assert MARKER in text, f"README.md has no {MARKER!r} marker before the error example"
    block = re.match(r".*?-->\n```text\n(.*?)```", text[text.index(MARKER):], re.S)
    assert block, "the marker must be followed by a ```text block"
    command, _, output = block.group(1).partition("\n")
    assert command.startswith("$ qarl "), command
    return shlex.split(command[len("$ qarl "):]), output


def test_readme_error_example_is_the_real_output(monkeypatch, capsys):
    """Run from the repository root, the README's bad-recipe command exits with status 2 and
    prints exactly the block's lines (stderr), nothing on stdout."""
    argv, expected = readme_example()
    monkeypatch.chdir(ROOT)
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == expected
