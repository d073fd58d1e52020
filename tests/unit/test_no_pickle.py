"""Nothing in qarl unpickles: weights are safetensors (or GGUF), everything else JSON / TOML,
and reward workers speak JSON. Checked on the code itself (the syntax tree of every module
under qarl/), so a docstring that mentions pickles is not a finding."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "qarl"
PICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "shelve", "joblib",
                    "marshal", "copyreg"}
SAFE_KEYWORDS = {"weights_only": True, "allow_pickle": False}  # any other value may unpickle


def _findings(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"import {a.name}") for a in node.names
                      if a.name.split(".")[0] in PICKLING_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PICKLING_MODULES:
            found.append((node.lineno, f"from {node.module} import"))
        elif isinstance(node, ast.Attribute):
            base = node.value.id if isinstance(node.value, ast.Name) else None
            if base == "torch" and node.attr == "load":
                found.append((node.lineno, "torch.load"))
            if node.attr in ("send", "recv") and isinstance(getattr(node, "ctx", None), ast.Load):
                found.append((node.lineno, f".{node.attr}() (a Connection pickles its objects)"))
        elif isinstance(node, ast.keyword) and node.arg in SAFE_KEYWORDS:
            value = node.value
            if not (isinstance(value, ast.Constant) and value.value is SAFE_KEYWORDS[node.arg]):
                found.append((node.lineno, f"{node.arg}={ast.unparse(value)}"))
    return found


def test_the_package_never_unpickles():
    """No module under qarl/ imports a pickling module, calls torch.load, passes
    weights_only=False / allow_pickle, or calls .send() / .recv() (multiprocessing
    Connections pickle; qarl's pipes carry JSON bytes via send_bytes / recv_bytes)."""
    findings = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        findings += [f"{path.relative_to(PACKAGE.parent)}:{line}: {what}"
                     for line, what in _findings(tree)]
    assert findings == []


def test_the_scan_finds_what_it_looks_for():
    """The scan is not vacuous: each forbidden form in a sample module is reported."""
    sample = ast.parse(
        "import pickle\nfrom dill import loads\nimport torch\ntorch.load('x')\n"
        "torch.load('y', weights_only=False)\nconn.send(obj)\nconn.recv()\n"
        "np.load('z', allow_pickle=True)\nconn.send_bytes(b'{}')\n"
    )
    whats = [what for _, what in _findings(sample)]
    assert whats.count("torch.load") == 2
    for expected in ("import pickle", "from dill import", "weights_only=False",
                     ".send() (a Connection pickles its objects)", ".recv() (a Connection pickles "
                     "its objects)", "allow_pickle=True"):
        assert expected in whats, expected
    assert len(whats) == 8
