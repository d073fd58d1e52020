"""The RL trainer (`train`), warm-start SFT, the aligned learner, checkpoints and metrics.

`train` is imported lazily so `import qarl.train.optim` stays light.
"""


def train(recipe=None, overrides=None):
    """Run RL training from a recipe (see qarl.train.trainer.train)."""
    from qarl.train.trainer import train as _train

    return _train(recipe, overrides)


__all__ = ["train"]
