"""Fixtures for the config tests: a minimal valid recipe and a way to write recipe files.

The checks run against the real registries (qarl.algo, qarl.quant, qarl.tasks, qarl.model)."""

from __future__ import annotations

import pytest

BASE_TOML = """\
[task]
name = "addition"

[train]
steps = 2
lr = 1e-4
"""


@pytest.fixture
def base_toml():
    """A minimal valid recipe (a built-in task and the two required train keys)."""
    return BASE_TOML


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(text, name='recipe') -> path of a TOML file holding `text`."""
    def write(text: str, name: str = "recipe") -> str:
        path = tmp_path / f"{name}.toml"
        path.write_text(text, encoding="utf-8")
        return str(path)

    return write
