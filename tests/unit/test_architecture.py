"""The import rule of docs/architecture.md holds for every module under qarl/, read from the
doc itself, so the rule and the code cannot drift; no import circle between modules; no file
over 400 lines."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "qarl"
DOC = ROOT / "docs" / "architecture.md"
MAX_LINES = 400


def read_rules() -> tuple[dict[str, set[str] | None], dict[str, set[str]]]:
    """({package: qarl packages it may import, None = any}, {package: banned third-party
    modules}) from the ```import-rules block of docs/architecture.md."""
    block = re.search(r"```import-rules\n(.*?)```", DOC.read_text(), re.S)
    assert block, f"{DOC} has no ```import-rules block"
    allowed: dict[str, set[str] | None] = {}
    banned: dict[str, set[str]] = {}
    for line in block.group(1).splitlines():
        match = re.fullmatch(r"(\w+)\s+(may import|never imports):\s*(.*)", line.strip())
        assert match, f"unreadable line in {DOC.name}'s import-rules block: {line!r}"
        package, verb, rest = match.groups()
        names = set() if rest == "(none)" else {n.strip() for n in rest.split(",")}
        if verb == "never imports":
            banned[package] = names
        else:
            allowed[package] = None if names == {"*"} else names
    return allowed, banned


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    """qarl.rollout.engine -> rollout; qarl.types -> types; qarl -> qarl (the public API)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "qarl"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in `path`, module level and inside functions.
    `from qarl import native` names the module qarl.native; `from qarl.model import ZOO` names
    qarl.model; `from torch import Tensor` names torch."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                here = module_name(path).split(".")
                here = here if path.name == "__init__.py" else here[:-1]
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (ROOT / Path(*sub.split("."))).with_suffix(".py").is_file() or (
                    ROOT / Path(*sub.split("."))
                ).is_dir()
                found.append((node.lineno, sub if is_module else base))
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_rules_name_every_package():
    """The doc's rule covers every package under qarl/ and names only real ones."""
    allowed, banned = read_rules()
    packages = {package_of(module_name(p)) for p in SOURCES}
    assert set(allowed) == packages, (sorted(packages - set(allowed)), sorted(set(allowed) - packages))
    named = set(banned) | {n for names in allowed.values() if names for n in names}
    assert named <= packages, sorted(named - packages)


def test_rules_say_what_the_code_imports():
    """The rule is tight: every package a rule lets a package import is imported by at least
    one of its modules (a stale permission would hide the next wrong import)."""
    allowed, _ = read_rules()
    used: dict[str, set[str]] = {}
    for path in SOURCES:
        package = package_of(module_name(path))
        used.setdefault(package, set()).update(
            package_of(t) for _, t in imports(path) if t.split(".")[0] == "qarl")
    unused = {package: sorted(may - used.get(package, set()))
              for package, may in allowed.items() if may is not None and may - used.get(package, set())}
    assert not unused, unused


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_rule(path):
    """Every import in the file (module level and inside functions) of a qarl package is one
    the doc allows its package; no import of a third-party module the doc bans."""
    allowed, banned = read_rules()
    package = package_of(module_name(path))
    may = allowed[package]
    problems = []
    for line, target in imports(path):
        root = target.split(".")[0]
        if root in banned.get(package, set()):
            problems.append(f"{path.relative_to(ROOT)}:{line} imports {target}, but "
                            f"docs/architecture.md says '{package} never imports: {root}'")
        if root != "qarl" or may is None:
            continue
        other = package_of(target)
        if other != package and other not in may:
            rule = ", ".join(sorted(may)) or "(none)"
            problems.append(f"{path.relative_to(ROOT)}:{line} imports {target}, but "
                            f"docs/architecture.md says '{package} may import: {rule}'")
    assert not problems, "\n".join(problems)


def test_no_import_circle():
    """No module imports itself back through other modules (a cycle in the graph module ->
    imported qarl module). Imports inside functions count too: deferring an import hides a
    circle, it does not break it."""
    graph = {module_name(p): {t for _, t in imports(p)
                              if t.split(".")[0] == "qarl"} for p in SOURCES}
    cycles = []
    state: dict[str, str] = {}  # module -> "open" while on the DFS stack, "done" after

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target, stack + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import circles:\n" + "\n".join(cycles)


def test_files_stay_small():
    """No .py file under qarl/ is over 400 lines."""
    long = {str(p.relative_to(ROOT)): n for p in SOURCES
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
