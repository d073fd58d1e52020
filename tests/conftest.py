"""Fixtures shared by every test package. Keep this file small."""

from __future__ import annotations

import pytest


@pytest.fixture
def qarl_home(tmp_path, monkeypatch):
    """A fresh, empty $QARL_HOME for one test (the zoo prepares into it)."""
    home = tmp_path / "qarl_home"
    monkeypatch.setenv("QARL_HOME", str(home))
    return home


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A folder holding the zoo's `tiny` model and tokenizer, built once per session outside
    $QARL_HOME: pass it to qarl.load_model / qarl.load_tokenizer."""
    from qarl.model.zoo import build_tiny

    folder = tmp_path_factory.mktemp("tiny")
    build_tiny(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    """The zoo's `tiny-moe` model and tokenizer, built once per session (like `tiny_dir`)."""
    from qarl.model.zoo import build_tiny

    folder = tmp_path_factory.mktemp("tiny_moe")
    build_tiny(folder, moe=True)
    return folder
