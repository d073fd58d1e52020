"""`dataset`: a task made of a JSONL / Parquet file and a named reward.

Train/eval: with `eval_path`, the two files are the splits; without it, each row is assigned
to eval by a hash of its prompt text (`eval_fraction` of the prompts), so identical prompts
always land in the same split. `examples(split, n, seed)` shuffles the split by the seed and
cycles through it (every row once before any repeat).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from qarl.tasks.base import Example, RewardFn, check_options, check_split_args, split_of
from qarl.tasks.datasets import DatasetReport, load_dataset
from qarl.tasks.rewards import load_reward, resolve_spec


class DatasetTask:
    """Examples from a file, scored by `reward` (a built-in name or "module:function")."""

    def __init__(
        self,
        path: str,
        reward: str = "math_answer",
        eval_path: str | None = None,
        eval_fraction: float = 0.1,
        max_prompt_len: int | None = None,
    ) -> None:
        problems = []
        if not isinstance(path, str) or not path:
            problems.append(f"path must name a .jsonl or .parquet file, got {path!r}")
        if not (isinstance(eval_fraction, float | int) and 0 <= eval_fraction < 1):
            problems.append(f"eval_fraction must be in [0, 1), got {eval_fraction!r}")
        if max_prompt_len is not None and not (
            isinstance(max_prompt_len, int) and max_prompt_len > 0
        ):
            problems.append(
                f"max_prompt_len must be a positive integer or None, got {max_prompt_len!r}"
            )
        check_options("dataset", problems)
        self.name = "dataset"
        self.reward_spec = resolve_spec(reward)
        self._reward: RewardFn | None = None  # loaded on first use: the trainer scores in workers
        rows, self.report = load_dataset(path, max_prompt_len)
        self.eval_report: DatasetReport | None = None
        if eval_path is not None:
            self._splits = {"train": rows}
            self._splits["eval"], self.eval_report = load_dataset(eval_path, max_prompt_len)
        else:
            self._splits = {"train": [], "eval": []}
            for example in rows:
                self._splits[split_of(example.prompt, eval_fraction)].append(example)

    def drop_rows(self, too_long: Callable[[Example], bool]) -> int:
        """Remove the rows for which `too_long(example)` holds (the trainer's token count of
        the templated prompt over task.max_prompt_tokens), counted as `too_long` in the report
        of the file they came from; returns how many. Raises ValueError if a split is left
        empty."""
        dropped = 0
        for split, rows in self._splits.items():
            report = self.eval_report if split == "eval" and self.eval_report else self.report
            kept = []
            for example in rows:
                if too_long(example):
                    report.add_bad("too_long", example.row)
                    report.kept -= 1
                    dropped += 1
                else:
                    kept.append(example)
            self._splits[split] = kept
        if not self._splits["train"]:
            raise ValueError(f"no usable rows left in the train split: {self.report.summary()}")
        return dropped

    def split_size(self, split: str) -> int:
        """Number of distinct rows in a split."""
        check_split_args(split, 0)
        return len(self._splits[split])

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        check_split_args(split, n)
        pool = list(self._splits[split])
        if not pool and n > 0:
            raise ValueError(
                f"the {split} split of the dataset is empty ({self.report.summary()}); "
                "give eval_path, or an eval_fraction that leaves rows in both splits"
            )
        random.Random(f"{split}:{seed}").shuffle(pool)
        return [pool[i % len(pool)] for i in range(n)]

    def reward(self, prompt: str, completion: str, **fields: Any) -> float | None:
        if self._reward is None:
            self._reward = load_reward(self.reward_spec)
        return self._reward(prompt, completion, **fields)

    def reference_completion(self, example: Example) -> str:
        """The row's `completion` column (for warm-start SFT); raises if the file has none."""
        if "completion" not in example.fields:
            raise ValueError(
                "this dataset has no 'completion' column, so there is no reference completion; "
                "add one to the file to warm-start by SFT"
            )
        return str(example.fields["completion"])
