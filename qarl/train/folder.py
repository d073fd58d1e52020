"""A run's folder (`RunFolder`: created, locked, the resolved recipe saved in it) and
`open_run`, which yields the folder, the policy pair (qarl.train.policy) and the data side
(qarl.train.data) and closes them after."""

from __future__ import annotations

import fcntl
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterator

import torch
from torch import nn

from qarl.config import RunConfig, save_resolved
from qarl.errors import UserError
from qarl.model import CausalLM, load_tokenizer
from qarl.train.data import Data, build_data
from qarl.train.policy import Policy, build_policy


@dataclass
class RunFolder:
    """The run's output folder, locked while the run lives: one process per folder."""

    path: Path
    lock: IO

    def close(self) -> None:
        self.lock.close()  # releases the flock


def lock_run_dir(run_dir: Path) -> IO:
    """An exclusive lock on the run folder: two processes writing one folder's metrics and
    checkpoints would corrupt both runs."""
    handle = open(run_dir / ".lock", "w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UserError(
            f"another qarl process is running in {run_dir}; wait for it, or give this run "
            f"another name (--run.name=...) or output folder (--run.output_dir=...)"
        ) from None
    return handle


def open_run_folder(config: RunConfig) -> RunFolder:
    """Create and lock `run.output_dir / run.name`, and save the resolved recipe there."""
    path = Path(config.run.output_dir) / config.run.name
    path.mkdir(parents=True, exist_ok=True)
    folder = RunFolder(path, lock_run_dir(path))
    try:
        save_resolved(config, path)
    except BaseException:
        folder.close()
        raise
    return folder


@contextmanager
def open_run(config: RunConfig, learner: CausalLM | Callable[[], CausalLM | None] | None = None
             ) -> Iterator[tuple[RunFolder, Policy, Data]]:
    """The run's folder, data side and policy pair, closed (lock, reward workers) on exit.
    `learner`, when given, replaces loading `model.name` (warm-started weights), or makes them
    (a function, called once the data side is built). The folder and the data side come
    first: a folder in use, a task that does not fit or a reward that does not load is
    refused before any model loads."""
    with closing(open_run_folder(config)) as folder:
        tokenizer = load_tokenizer(config.model.name)
        with closing(build_data(config, tokenizer, folder.path)) as data:
            model = learner if learner is None or isinstance(learner, nn.Module) else learner()
            torch.manual_seed(config.run.seed)  # the policy's random init (LoRA) and the run's
            with closing(build_policy(config, tokenizer, model, folder.path)) as policy:
                yield folder, policy, data
