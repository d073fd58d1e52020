"""The RL trainer (`train`), warm-start SFT, the aligned learner, checkpoints and metrics.

`train` is imported lazily so `import qarl.train.learner.optim` stays light. `qarl.train(...)` (the
public API) calls it even once this package is imported: importing any `qarl.train.*` module
makes `qarl.train` the package, so the package itself is callable.
"""

import sys
import types


def train(recipe=None, overrides=None):
    """Run RL training from a recipe (see qarl.train.trainer.train)."""
    from qarl.train.trainer import train as _train

    return _train(recipe, overrides)


class _CallablePackage(types.ModuleType):
    def __call__(self, recipe=None, overrides=None):
        return train(recipe, overrides)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["train"]
