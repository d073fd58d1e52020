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


@pytest.fixture(scope="module")
def ray_session(request):
    """A local Ray (2 CPUs) for one test module; functions defined in the module ship to the
    actors by value (they are not importable there). Skips where ray is not installed."""
    import signal

    ray = pytest.importorskip("ray")
    handler = signal.getsignal(signal.SIGTERM)  # ray.init installs its own
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             object_store_memory=200 * 2**20)
    ray.cloudpickle.register_pickle_by_value(request.module)
    yield
    ray.shutdown()
    signal.signal(signal.SIGTERM, handler)
