"""The public API of the README (`import qarl`, then `qarl.NAME`) resolves to the documented
objects, whatever else was imported first."""

from __future__ import annotations

import subprocess
import sys


def test_qarl_train_is_callable_after_its_package_is_imported():
    """`qarl.train(...)` calls the trainer even after `import qarl.train.checkpoint` made
    `qarl.train` the package (a fresh interpreter, so nothing else was imported first)."""
    code = ("import qarl, qarl.train.checkpoint, qarl.train.trainer as t\n"
            "t.train = lambda recipe=None, overrides=None: ('called', recipe, overrides)\n"
            "print(qarl.train('tiny', {'train.steps': 1}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "('called', 'tiny', {'train.steps': 1})"


def test_every_public_name_resolves():
    """Each name of qarl.__all__ is importable as documented."""
    import qarl

    for name in qarl.__all__:
        assert getattr(qarl, name) is not None, name
