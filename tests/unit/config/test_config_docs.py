"""docs/config.md is generated from the schema and stays in sync with it."""

from __future__ import annotations

from pathlib import Path

from qarl.config import SECTIONS
from qarl.config.markdown import generate_markdown

DOC = Path(__file__).resolve().parents[3] / "docs" / "config.md"


def test_committed_reference_is_current():
    """docs/config.md equals `python -m qarl.config --markdown` (regenerate it if this fails)."""
    assert DOC.read_text(encoding="utf-8") == generate_markdown(), (
        "docs/config.md is stale: run `.venv/bin/python -m qarl.config --markdown > docs/config.md`"
    )


def test_reference_lists_every_key():
    """Every section and every key of the schema appears in the reference."""
    text = generate_markdown()
    for section, model in SECTIONS.items():
        assert f"## [{section}]" in text
        for key in model.model_fields:
            assert f"**`{key}`**" in text, f"{section}.{key}"
