"""What a task is: examples to prompt with, and a reward to score completions.

A task hands the trainer `Example`s (prompt text + gold answer + optional system prompt and
extra fields) and scores completions with `reward(prompt, completion, **example.reward_kwargs())`.
Rewards must also run in worker processes (see `runner.py`), so every task names its reward as a
`"module:function"` string in `reward_spec`; `task.reward` is that same function.

Train and eval splits are disjoint as *problem sets*: each problem is assigned to one split by a
hash of its canonical text (`split_of`), never by the seed, so no seed can leak an eval problem
into training.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SPLITS = ("train", "eval")

# Keys a reward receives positionally; a dataset column with one of these names stays in
# `Example.fields` (e.g. a reference "completion" for SFT) but is not passed to the reward.
_POSITIONAL_REWARD_ARGS = ("prompt", "completion")


@dataclass
class Example:
    """One prompt with what is needed to score completions of it."""

    prompt: str  # the user message (the trainer applies the chat template)
    answer: str  # gold answer, as text
    system: str | None = None  # optional system prompt
    fields: dict[str, Any] = field(default_factory=dict)  # extra columns, passed to the reward
    row: int | None = field(default=None, compare=False)  # its row in a dataset file (1-based)

    def reward_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `reward(prompt, completion, **kwargs)`: answer + extra fields."""
        extra = {k: v for k, v in self.fields.items() if k not in _POSITIONAL_REWARD_ARGS}
        return {**extra, "answer": self.answer}


RewardFn = Callable[..., "float | None"]


@runtime_checkable
class Task(Protocol):
    """A source of examples and their reward.

    Optional members, present only where they make sense:
      `grammar_ok(completion) -> bool`: the completion follows the task's output grammar
        (used by the `garbled` diagnostic);
      `reference_completion(example) -> str`: a gold completion (warm-start SFT), which the
        task's own reward scores 1.0.
    """

    name: str
    reward_spec: str  # "module:function" of `reward`, importable in a worker process

    def examples(self, split: str, n: int, seed: int) -> list[Example]: ...

    def reward(self, prompt: str, completion: str, **fields: Any) -> float | None: ...


def check_split_args(split: str, n: int) -> None:
    """Raise if `split` is not a known split or `n` is negative."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid splits: {sorted(SPLITS)}")
    if n < 0:
        raise ValueError(f"number of examples must be >= 0, got {n}")


def split_of(key: str, eval_fraction: float) -> str:
    """The split ("train" or "eval") that problem `key` belongs to, fixed by a hash of the key.

    A problem is in eval iff the first 8 bytes of sha256(key), as an integer in [0, 2^64),
    fall below eval_fraction * 2^64.
    """
    h = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big")
    return "eval" if h < eval_fraction * 2**64 else "train"


def sample_split(
    split: str,
    n: int,
    seed: int,
    draw: Callable[[random.Random], Any],
    key: Callable[[Any], str],
    eval_fraction: float,
    enumerate_all: Callable[[], Iterable[Any]] | None = None,
) -> list[Any]:
    """n problems of one split, deterministic in (split, n, seed).

    Small problem spaces (the task passes `enumerate_all`, a function listing every problem):
    the split's problems are shuffled by the seed and cycled, so every problem appears once
    before any repeats. Large spaces: problems are drawn by `draw(rng)` and kept when their
    hash puts them in `split` (rejection sampling; repeats possible but rare).
    """
    check_split_args(split, n)
    rng = random.Random(f"{split}:{seed}")
    if enumerate_all is not None:
        pool = [p for p in enumerate_all() if split_of(key(p), eval_fraction) == split]
        if not pool and n > 0:
            raise ValueError(
                f"the {split} split of this problem space is empty "
                f"(eval_fraction={eval_fraction}); choose an eval_fraction nearer 0.5 "
                "or a larger problem space"
            )
        rng.shuffle(pool)
        return [pool[i % len(pool)] for i in range(n)]
    out: list[Any] = []
    attempts = 0
    while len(out) < n:
        problem = draw(rng)
        attempts += 1
        if split_of(key(problem), eval_fraction) == split:
            out.append(problem)
        elif attempts > 1000 * (n + 1):
            raise ValueError(
                f"could not draw {n} {split} problems in {attempts} attempts "
                f"(eval_fraction={eval_fraction}); choose an eval_fraction between 0.01 and 0.99"
            )
    return out


def check_options(task_name: str, problems: list[str]) -> None:
    """Raise once with every problem found in a task's options."""
    if problems:
        raise ValueError(f"invalid options for task {task_name!r}: " + "; ".join(problems))
