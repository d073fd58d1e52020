"""Dataset files: every kind of bad row is counted exactly, never dropped silently."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from qarl.tasks import DatasetTask, load_dataset, make_task

GOOD = [
    {"prompt": "1+1?", "answer": "2"},
    {"prompt": "half?", "answer": 0.5, "system": "Be brief.", "level": 3},
    {"prompt": "ten?", "answer": 10, "completion": "10"},
]


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_with_every_kind_of_bad_row(tmp_path):
    """Each bad-row reason is counted exactly, with its line numbers; good rows are kept
    with system prompt and extra fields; blank lines are not rows."""
    lines = [json.dumps(r) for r in GOOD] + [
        "{not json",                                   # 4 unparseable_json
        json.dumps(["a", "list"]),                      # 5 wrong_type (not an object)
        json.dumps({"prompt": 7, "answer": "1"}),        # 6 wrong_type (prompt)
        json.dumps({"prompt": "p", "answer": True}),     # 7 wrong_type (bool answer)
        json.dumps({"prompt": "   ", "answer": "1"}),    # 8 empty_prompt
        json.dumps({"answer": "1"}),                     # 9 empty_prompt (missing)
        json.dumps({"prompt": "p"}),                     # 10 missing_answer
        json.dumps({"prompt": "p", "answer": None}),     # 11 missing_answer
        json.dumps({"prompt": "x" * 50, "answer": "1"}), # 12 too_long
        "",                                             # 13 blank: not a row
        json.dumps({"prompt": "p", "answer": "1", "system": 3}),  # 14 wrong_type (system)
    ]
    examples, report = load_dataset(_write_jsonl(tmp_path / "d.jsonl", lines), max_prompt_len=20)
    assert report.bad == {"empty_prompt": 2, "missing_answer": 2, "not_utf8": 0, "too_long": 1,
                          "unparseable_json": 1, "wrong_type": 4}
    assert report.bad_rows == {"unparseable_json": [4], "wrong_type": [5, 6, 7, 14],
                               "empty_prompt": [8, 9], "missing_answer": [10, 11],
                               "too_long": [12]}
    assert (report.rows, report.kept, report.num_bad) == (13, 3, 10)
    assert [e.answer for e in examples] == ["2", "0.5", "10"]
    assert examples[1].system == "Be brief." and examples[1].fields == {"level": 3}
    assert "kept 3 of 13" in report.summary() and "too_long=1 (rows 12)" in report.summary()


def test_length_function_bounds_tokens_not_characters(tmp_path):
    """A custom length_fn (e.g. a token count) decides what is too long."""
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "a b c d", "answer": "1"}),
                                               json.dumps({"prompt": "a b", "answer": "1"})])
    _, report = load_dataset(path, max_prompt_len=3, length_fn=lambda s: len(s.split()))
    assert report.bad["too_long"] == 1 and report.kept == 1


def test_all_rows_bad_raises_with_counts(tmp_path):
    """A file with no usable row raises, naming the counts."""
    path = _write_jsonl(tmp_path / "d.jsonl", ["{bad", json.dumps({"prompt": "p"})])
    with pytest.raises(ValueError, match="no usable rows.*missing_answer=1.*unparseable_json=1"):
        load_dataset(path)


def test_parquet_rows_and_bad_rows(tmp_path):
    """Parquet files load like JSONL; null prompts/answers are counted, extra columns kept."""
    table = pa.table({
        "prompt": ["1+1?", None, "2+2?", "3+3?"],
        "answer": ["2", "x", None, "6"],
        "source": ["a", "b", "c", "d"],
    })
    pq.write_table(table, tmp_path / "d.parquet")
    examples, report = load_dataset(tmp_path / "d.parquet")
    assert report.bad["empty_prompt"] == 1 and report.bad["missing_answer"] == 1
    assert report.bad_rows == {"empty_prompt": [2], "missing_answer": [3]}
    assert [(e.prompt, e.answer, e.fields) for e in examples] == [
        ("1+1?", "2", {"source": "a"}), ("3+3?", "6", {"source": "d"})]


def test_unknown_extension_and_missing_file(tmp_path):
    """Unknown extensions list the valid ones; a missing file says so."""
    with pytest.raises(ValueError, match="valid extensions"):
        load_dataset(tmp_path / "d.csv")
    with pytest.raises(FileNotFoundError):
        load_dataset(tmp_path / "nope.jsonl")


def test_dataset_task_splits_by_prompt_hash_and_cycles(tmp_path):
    """The dataset task splits rows by prompt hash (disjoint), cycles a split before repeating,
    scores with the named reward and serves the `completion` column as reference."""
    rows = [json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1),
                        "completion": str(i + 1)}) for i in range(60)]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    task = make_task("dataset", path=str(path), reward="addition", eval_fraction=0.25)
    assert isinstance(task, DatasetTask)
    n_train, n_eval = task.split_size("train"), task.split_size("eval")
    assert n_train + n_eval == 60 and n_eval > 0
    train = task.examples("train", n_train, seed=0)
    assert len({e.prompt for e in train}) == n_train
    assert not {e.prompt for e in train} & {e.prompt for e in task.examples("eval", 50, seed=0)}
    ex = train[0]
    assert task.reward(ex.prompt, task.reference_completion(ex), **ex.reward_kwargs()) == 1.0


def test_bad_bytes_and_a_byte_order_mark(tmp_path):
    """A line that is not UTF-8 is a counted `not_utf8` row, not a crash; a UTF-8 byte-order
    mark before the first row is dropped (the row is kept)."""
    path = tmp_path / "d.jsonl"
    rows = [json.dumps(r).encode() for r in GOOD]
    path.write_bytes(b"\xef\xbb\xbf" + rows[0] + b"\n" + b'{"prompt": "caf\xe9", "answer": "1"}\n'
                     + b"\n".join(rows[1:]) + b"\n")
    examples, report = load_dataset(path)
    assert [e.prompt for e in examples] == [r["prompt"] for r in GOOD]
    assert report.bad["not_utf8"] == 1 and report.bad_rows["not_utf8"] == [2]
    assert [e.row for e in examples] == [1, 3, 4]
