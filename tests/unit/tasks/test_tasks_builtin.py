"""Built-in tasks: determinism, split disjointness, answer parsing, grammar, references."""

import pytest

from qarl.tasks import (
    TASKS,
    AdditionTask,
    ColumnAdditionTask,
    Example,
    Task,
    extract_answer,
    grammar_ok,
    make_task,
)
from qarl.tasks.addition import addition_reward, evaluate
from qarl.tasks.column_addition import column_addition_reward, column_lines


@pytest.mark.parametrize(
    "name,options",
    [("addition", {}), ("addition", {"digits": 3, "operands": 3, "operators": "+-*"}),
     ("column_addition", {}), ("column_addition", {"digits": 6, "operands": 3})],
)
def test_examples_are_deterministic_in_the_seed(name, options):
    """Same (options, split, n, seed) gives the same examples; another seed gives others."""
    task = make_task(name, **options)
    a = task.examples("train", 50, seed=3)
    assert a == task.examples("train", 50, seed=3)
    assert a == make_task(name, **options).examples("train", 50, seed=3)
    assert [e.prompt for e in a] != [e.prompt for e in task.examples("train", 50, seed=4)]


@pytest.mark.parametrize(
    "name,options",
    [("addition", {}), ("addition", {"digits": 2}), ("addition", {"digits": 4, "operands": 3}),
     ("column_addition", {"digits": 3})],
)
def test_train_and_eval_share_no_problem(name, options):
    """No prompt drawn for eval, under any seed, is ever drawn for train."""
    task = make_task(name, **options)
    train = {e.prompt for s in range(3) for e in task.examples("train", 300, seed=s)}
    evals = {e.prompt for s in range(3) for e in task.examples("eval", 100, seed=s)}
    assert train and evals and not train & evals


def test_one_digit_addition_partitions_the_100_pairs():
    """One-digit addition: train and eval partition all 100 ordered pairs, and a split lists
    every one of its problems before repeating any."""
    task = AdditionTask()
    train = task.examples("train", 200, seed=0)
    evals = task.examples("eval", 200, seed=0)
    n_train, n_eval = len({e.prompt for e in train}), len({e.prompt for e in evals})
    assert (n_train, n_eval) == (80, 20)  # eval_fraction 0.2 by hash; the README quotes 80/20
    assert len({e.prompt for e in evals[:n_eval]}) == n_eval


def test_addition_prompt_and_answer():
    """Prompts are plain questions with a short instruction; answers follow * before +/-."""
    ex = AdditionTask().examples("train", 1, seed=0)[0]
    assert ex.prompt.startswith("What is ") and ex.prompt.endswith("? Answer with just the number.")
    assert evaluate((2, 3, 4), ("+", "*")) == 14
    assert evaluate((2, 3, 4), ("-", "*")) == -10
    assert evaluate((2, 3, 4, 5), ("*", "-", "*")) == -14


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("8", 8),
        ("The answer is 8.", 8),
        ("3 + 5 = 8", 8),
        ("3 + 5 = 8. So the answer is 8", 8),
        ("**Answer:** 12\n\nBecause 5 + 7 = 12", 12),
        ("The answer is -7, since 2 - 9 = -7", -7),
        ("-15", -15),
        ("5-3", 3),  # a minus glued to a digit is subtraction, not a sign
        ("answer: 1,234", 1234),
        ("8.0", 8),
        ("8.5", None),
        ("eight", None),
        ("", None),
        ("The answer is 9 (not 10)", 9),  # the number after the last marker wins
        ("I think 4 and then 6", 6),  # no marker: the last number
    ],
)
def test_extract_answer_rule(completion, expected):
    """The documented answer rule: number after the last marker, else the last number."""
    assert extract_answer(completion) == expected


def test_addition_reward_values():
    """1.0 right, 0.0 wrong or no number, None only when the gold is not an integer."""
    assert addition_reward("q", "The answer is 8", answer="8") == 1.0
    assert addition_reward("q", "9", answer="8") == 0.0
    assert addition_reward("q", "no idea", answer="8") == 0.0
    assert addition_reward("q", "-3", answer=-3) == 1.0
    assert addition_reward("q", "8", answer="eight") is None


def test_column_grammar_accepts_and_rejects():
    """grammar_ok accepts ordered column lines + answer line, and rejects anything else."""
    good = "d0: 1+7+0=8 carry 0\nd1: 2+9+0=11 carry 1\nanswer: 118"
    assert grammar_ok(good)
    assert grammar_ok("  " + good + "\n")
    assert grammar_ok("d0: 9+9+9+0=27 carry 2\nanswer: 27")
    assert grammar_ok(good.replace("=8", "=9"))  # syntax only, not arithmetic
    assert not grammar_ok("answer: 118")  # no column line
    assert not grammar_ok(good.replace("d1", "d2"))  # out of order
    assert not grammar_ok(good + "\nthanks!")  # trailing text
    assert not grammar_ok("Sure!\n" + good)  # leading text
    assert not grammar_ok(good.replace("carry 1", "carry carry 1"))
    assert not grammar_ok("d0: to to to to\nanswer: 1")
    assert not grammar_ok(good.replace("answer: 118", "answer: 11 8"))


def test_column_lines_carry_and_final_digit():
    """Column lines carry correctly and a final carry reaches the answer."""
    assert column_lines((57, 68)) == ["d0: 7+8+0=15 carry 1", "d1: 5+6+1=12 carry 1"]
    assert column_lines((999, 1)) == [
        "d0: 9+1+0=10 carry 1", "d1: 9+0+1=10 carry 1", "d2: 9+0+1=10 carry 1"]


@pytest.mark.parametrize("task", [AdditionTask(), AdditionTask(digits=3, operators="+-*"),
                                  ColumnAdditionTask(), ColumnAdditionTask(digits=9, operands=4)])
def test_reference_completions_score_one_and_follow_the_grammar(task):
    """Every reference completion gets reward 1.0 (and passes the grammar where one exists)."""
    for ex in task.examples("train", 40, seed=1) + task.examples("eval", 10, seed=1):
        ref = task.reference_completion(ex)
        assert task.reward(ex.prompt, ref, **ex.reward_kwargs()) == 1.0
        if hasattr(task, "grammar_ok"):
            assert task.grammar_ok(ref)


def test_column_reward_reads_the_last_answer_line():
    """Column reward: the last `answer:` line counts; none at all is 0.0; never None."""
    assert column_addition_reward("q", "d0: 1+1+0=2 carry 0\nanswer: 2", answer="2") == 1.0
    assert column_addition_reward("q", "answer: 3\nanswer: 2", answer="2") == 1.0
    assert column_addition_reward("q", "2", answer="2") == 0.0
    with pytest.raises(ValueError, match="integer gold answer"):
        column_addition_reward("q", "answer: 2", answer=None)


def test_tasks_satisfy_the_protocol_and_reward_specs_resolve():
    """Each built-in task is a Task and its reward_spec names its own reward function."""
    from qarl.tasks import load_reward

    for task in (AdditionTask(), ColumnAdditionTask()):
        assert isinstance(task, Task)
        fn = load_reward(task.reward_spec)
        ex = task.examples("train", 1, seed=0)[0]
        ref = task.reference_completion(ex)
        assert fn(ex.prompt, ref, **ex.reward_kwargs()) == 1.0


def test_make_task_validates_names_and_options():
    """Unknown task names and options raise with the valid ones; bad values all at once."""
    with pytest.raises(ValueError, match=r"valid tasks: \['addition', 'column_addition'"):
        make_task("multiplication")
    with pytest.raises(ValueError, match="unknown option 'digit'.*valid options"):
        make_task("addition", digit=2)
    with pytest.raises(ValueError, match="digits must be.*operators must be"):
        make_task("addition", digits=0, operators="/")
    with pytest.raises(ValueError, match="missing required option 'path'"):
        make_task("dataset")
    assert sorted(TASKS) == ["addition", "column_addition", "dataset", "reasoning_gym"]


def test_bad_split_and_n_raise():
    """examples() refuses an unknown split name and a negative count."""
    with pytest.raises(ValueError, match="valid splits"):
        AdditionTask().examples("test", 1, seed=0)
    with pytest.raises(ValueError, match=">= 0"):
        AdditionTask().examples("train", -1, seed=0)


def test_reward_kwargs_keep_fields_but_not_positional_names():
    """Example.reward_kwargs passes extra fields and the answer, never prompt/completion."""
    ex = Example(prompt="p", answer="1", fields={"level": 3, "completion": "ref"})
    assert ex.reward_kwargs() == {"level": 3, "answer": "1"}


def test_importing_tasks_loads_neither_torch_nor_sympy():
    """qarl.tasks stays light for reward workers: no torch, no sympy (math-verify) on import."""
    import subprocess
    import sys

    code = "import qarl.tasks, sys; print('torch' in sys.modules, 'sympy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
