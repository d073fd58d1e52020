"""Dataset files (JSONL, Parquet) as Examples, with every bad row counted by reason.

A row needs `prompt` (non-empty string) and `answer` (string or number; numbers become text);
`system` (string) is optional; every other column is kept in `Example.fields` and passed to
the reward. Rows are never dropped silently: `DatasetReport` counts bad rows per reason and
keeps the first few row numbers (1-based: the line number in JSONL, the row number in Parquet).
Whitespace-only JSONL lines are not rows and are not counted. If no row is usable, loading
raises with the counts.

Bad-row reasons:
  not_utf8          the JSONL line is not UTF-8 text (a byte-order mark on the first line is
                    fine: it is dropped)
  unparseable_json  the JSONL line is not valid JSON
  wrong_type        the row is not an object, or prompt/system is not a string, or answer is
                    not a string or number (booleans, lists and objects are refused)
  empty_prompt      prompt missing, null, or only whitespace
  missing_answer    answer missing, null, or only whitespace
  too_long          length_fn(prompt) > max_prompt_len, or (counted by the trainer, which
                    knows the tokenizer: `DatasetTask.drop_rows`) the templated prompt has
                    more than task.max_prompt_tokens tokens
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qarl.tasks.base import Example

BAD_ROW_REASONS = ("empty_prompt", "missing_answer", "not_utf8", "too_long", "unparseable_json",
                   "wrong_type")
_EXAMPLE_ROWS_KEPT = 5
_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}


@dataclass
class DatasetReport:
    """What `load_dataset` kept and refused."""

    path: str
    rows: int = 0  # rows read (kept + bad)
    kept: int = 0
    bad: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BAD_ROW_REASONS, 0))
    bad_rows: dict[str, list[int]] = field(default_factory=dict)  # reason -> first row numbers

    @property
    def num_bad(self) -> int:
        return sum(self.bad.values())

    def add_bad(self, reason: str, row_number: int) -> None:
        self.bad[reason] += 1
        seen = self.bad_rows.setdefault(reason, [])
        if len(seen) < _EXAMPLE_ROWS_KEPT:
            seen.append(row_number)

    def summary(self) -> str:
        """One line: kept/read and each non-zero bad reason with example row numbers."""
        parts = [
            f"{reason}={count} (rows {', '.join(map(str, self.bad_rows[reason]))}"
            + (", ...)" if count > len(self.bad_rows[reason]) else ")")
            for reason, count in self.bad.items()
            if count
        ]
        bad = "; bad rows: " + "; ".join(parts) if parts else "; no bad rows"
        return f"{self.path}: kept {self.kept} of {self.rows} rows{bad}"


def _jsonl_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value, or the _UNPARSEABLE / _NOT_UTF8 marker) per non-blank
    line; a UTF-8 byte-order mark before the first line is dropped."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if number == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                yield number, _NOT_UTF8
                continue
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError:
                yield number, _UNPARSEABLE


def _parquet_rows(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    for number, row in enumerate(pq.read_table(path).to_pylist(), start=1):
        yield number, row


_UNPARSEABLE, _NOT_UTF8 = object(), object()


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def row_problem(
    row: Any, max_prompt_len: int | None, length_fn: Callable[[str], int]
) -> str | None:
    """The bad-row reason of one parsed row, or None if it is usable."""
    if row is _UNPARSEABLE:
        return "unparseable_json"
    if row is _NOT_UTF8:
        return "not_utf8"
    if not isinstance(row, dict):
        return "wrong_type"
    prompt, answer, system = row.get("prompt"), row.get("answer"), row.get("system")
    if not (prompt is None or isinstance(prompt, str)) or not (
        system is None or isinstance(system, str)
    ):
        return "wrong_type"
    answer_is_text_or_number = isinstance(answer, str | int | float) and not isinstance(answer, bool)
    if not (answer is None or answer_is_text_or_number):
        return "wrong_type"
    if _blank(prompt):
        return "empty_prompt"
    if _blank(answer):
        return "missing_answer"
    if max_prompt_len is not None and length_fn(prompt) > max_prompt_len:
        return "too_long"
    return None


def load_dataset(
    path: str | Path,
    max_prompt_len: int | None = None,
    length_fn: Callable[[str], int] = len,
) -> tuple[list[Example], DatasetReport]:
    """Examples of a JSONL or Parquet file and the report of bad rows.

    `max_prompt_len` bounds `length_fn(prompt)`: characters by default; pass a tokenizer's
    length (e.g. `lambda s: len(tok.encode(s))`) to bound tokens. Raises FileNotFoundError,
    ValueError for an unknown extension, and ValueError with the counts if no row is usable.
    """
    path = Path(path)
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"unknown dataset file type {path.suffix!r} for {path}; "
            f"valid extensions: {sorted(_FORMATS)}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    rows = _jsonl_rows(path) if fmt == "jsonl" else _parquet_rows(path)
    report, examples = DatasetReport(path=str(path)), []
    for number, row in rows:
        report.rows += 1
        problem = row_problem(row, max_prompt_len, length_fn)
        if problem is not None:
            report.add_bad(problem, number)
            continue
        extra = {k: v for k, v in row.items() if k not in ("prompt", "answer", "system")}
        answer = str(row["answer"]).strip()
        examples.append(Example(row["prompt"], answer, row.get("system"), extra, row=number))
    report.kept = len(examples)
    if not examples:
        raise ValueError(f"no usable rows in dataset: {report.summary()}")
    return examples, report
