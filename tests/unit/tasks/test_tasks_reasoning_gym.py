"""The reasoning_gym task on the real reasoning-gym package, offline: splits drawn from
different seeds and disjoint by text, the reward = the generator's own scorer on the extracted
answer, mixtures by weight, and options refused at config load."""

from __future__ import annotations

import socket
import sys
from collections import Counter

import pytest

pytest.importorskip("reasoning_gym")

from qarl.config import ConfigError, load_config  # noqa: E402
from qarl.tasks import RewardRunner, make_task  # noqa: E402
from qarl.tasks.reasoning_gym_task import EVAL_SEED, extract_answer  # noqa: E402

# One-digit chain sums of two terms: about 200 distinct problems, so a 60-problem eval pool
# takes a large share of the space and the training draw must skip it.
SMALL = {"dataset": "chain_sum", "min_terms": 2, "max_terms": 2, "min_digits": 1,
         "max_digits": 1}
# Generators the suitability benchmark uses; each must generate and score offline.
OFFLINE = ["chain_sum", "basic_arithmetic", "spell_backward", "letter_counting",
           "number_sorting", "gcd", "count_bits", "word_sorting"]


def test_train_and_eval_from_different_seeds_and_disjoint():
    """The eval pool is fixed (the same for every seed, at seeds from 2^40 on) and training
    problems come from seeds below 2^31; over many training draws no training question is an
    eval question, although the small space makes collisions certain without the check."""
    task = make_task("reasoning_gym", eval_problems=60, **SMALL)
    pool = {ex.prompt for ex in task.eval_pool()}
    assert {ex.prompt for ex in task.examples("eval", 60, 1)} <= pool
    assert sorted(ex.prompt for ex in task.examples("eval", 60, 0)) == \
        sorted(ex.prompt for ex in task.examples("eval", 60, 7))
    assert all(ex.fields["source"]["seed"] >= EVAL_SEED for ex in task.eval_pool())
    train = [ex for seed in range(20) for ex in task.examples("train", 32, seed)]
    assert all(ex.fields["source"]["seed"] < 2**31 for ex in train)
    assert not pool & {ex.prompt for ex in train}
    unchecked = make_task("reasoning_gym", eval_problems=1, **SMALL)
    drawn = {ex.prompt for seed in range(20) for ex in unchecked.examples("train", 32, seed)}
    assert pool & drawn  # what the check removes is there to remove


def test_examples_are_deterministic_in_the_seed():
    """Same (split, n, seed): the same examples; another seed: other training problems."""
    task = make_task("reasoning_gym", dataset="basic_arithmetic")
    assert task.examples("train", 8, 3) == task.examples("train", 8, 3)
    assert task.examples("train", 8, 3) != task.examples("train", 8, 4)


@pytest.mark.parametrize("text, fallback, expected", [
    ("think... <answer>12</answer>", True, "12"),
    ("<answer> a </answer> then <answer>b</answer>", True, "b"),
    ("Let me add.\n\nThe answer to the problem is 12.\n", True, "12"),
    ("working\nAnswer: olleh", True, "olleh"),
    ("4 - 1 = -3", True, "-3"),
    ("The word is \"olleh\".", True, "olleh"),
    ("**12**", True, "12"),
    ("islands", True, "islands"),
    ("The answer is 12.", False, None),
    ("", True, None),
])
def test_extract_answer(text, fallback, expected):
    """The last <answer> tag's text; else, with the fallback, what follows the last ' is ',
    ':' or '=' of the last non-empty line (the line if none), without quotes, `*`, backticks
    and a final period; else None."""
    assert extract_answer(text, fallback) == expected


@pytest.mark.parametrize("dataset", OFFLINE)
def test_reward_is_the_generators_scorer(dataset):
    """The reference completion (the gold in the tag) scores what reasoning-gym's own scorer
    gives the gold, an empty completion scores 0, and the reward of a wrong tag is the
    scorer's for that text."""
    import reasoning_gym

    task = make_task("reasoning_gym", dataset=dataset, eval_problems=4)
    for ex in task.examples("train", 4, 0) + task.examples("eval", 4, 0):
        source = ex.fields["source"]
        ds = reasoning_gym.create_dataset(dataset, seed=source["seed"], size=source["size"],
                                          **source["params"])
        entry = ds[source["index"]]
        assert entry["question"] == ex.prompt
        gold = task.reward(ex.prompt, task.reference_completion(ex), **ex.reward_kwargs())
        assert gold == ds.score_answer(answer=entry["answer"], entry=entry) == 1.0
        assert task.reward(ex.prompt, "", **ex.reward_kwargs()) == 0.0
        wrong = task.reward(ex.prompt, "<answer>xyz</answer>", **ex.reward_kwargs())
        assert wrong == ds.score_answer(answer="xyz", entry=entry)


def test_generators_run_offline(monkeypatch):
    """Generating and scoring the benchmark's generators opens no connection."""
    def refuse(*args, **kwargs):
        raise AssertionError("a reasoning-gym generator tried to open a connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    for dataset in OFFLINE:
        task = make_task("reasoning_gym", dataset=dataset, eval_problems=2)
        for ex in task.examples("train", 2, 5) + task.examples("eval", 2, 5):
            assert task.reward(ex.prompt, task.reference_completion(ex),
                               **ex.reward_kwargs()) == 1.0


def test_mixture_draws_by_weight_and_scores_each_generator():
    """A mixture draws each generator in proportion to its weight (3:1 within sampling error
    over 800 draws) with its own parameters, and each example is scored by its generator."""
    task = make_task("reasoning_gym", eval_problems=20, mixture=[
        {"dataset": "chain_sum", "weight": 3, "max_terms": 2},
        {"dataset": "spell_backward", "max_word_len": 5}])
    examples = [ex for seed in range(25) for ex in task.examples("train", 32, seed)]
    counts = Counter(ex.fields["source"]["dataset"] for ex in examples)
    assert abs(counts["chain_sum"] / len(examples) - 0.75) < 0.05  # 3.3 sigma at n = 800
    for ex in examples[:40]:
        params = ex.fields["source"]["params"]
        assert params == ({"max_terms": 2} if "arithmetic" in ex.prompt else {"max_word_len": 5})
        assert task.reward(ex.prompt, task.reference_completion(ex), **ex.reward_kwargs()) == 1.0


def test_rewards_in_workers_equal_inline():
    """Through the reward runner (fields as JSON, the entry regenerated in the worker) the
    rewards are those computed in process; a source that regenerates another question is an
    error, never a score."""
    task = make_task("reasoning_gym", dataset="chain_sum", max_terms=3)
    examples = task.examples("train", 8, 0)
    answers = ["<answer>" + ex.answer + "</answer>" if i % 2 else "I think " + ex.answer[:-1]
               for i, ex in enumerate(examples)]
    calls = [(ex.prompt, a, ex.reward_kwargs()) for ex, a in zip(examples, answers)]
    calls.append(("another question", answers[0], examples[0].reward_kwargs()))
    with RewardRunner(task.reward_spec, num_workers=1, timeout_s=30) as runner:
        result = runner.score(calls)
    assert result.rewards[:8] == [task.reward(*call[:2], **call[2]) for call in calls[:8]]
    assert result.outcomes[8] == "error" and "regenerated another problem" in result.errors[8]


@pytest.mark.parametrize("options, fragments", [
    ('{dataset = "chain_sums"}', ["task.options.dataset: unknown reasoning-gym generator",
                                  "did you mean 'chain_sum'?"]),
    ('{dataset = "chain_sum", min_term = 2}', ["task.options.min_term: not a parameter",
                                               "did you mean 'min_terms'?"]),
    ('{dataset = "chain_sum", min_terms = 5, max_terms = 2}',
     ["task.options: 'chain_sum' rejects", "max_terms must be >= min_terms"]),
    ('{min_terms = 2}', ["task.options: give either dataset", "or mixture"]),
    ('{mixture = [{dataset = "gcd", weight = 0}]}', ["task.options.mixture.0.weight: 0 is not"]),
    ('{dataset = "gcd", system = "terse"}', ["task.options.system: 'terse' is not one of"]),
])
def test_bad_options_refused_at_load(options, fragments):
    """A generator that does not exist, a parameter it does not take or rejects, and the
    task's own option mistakes are refused when the recipe loads, one problem each."""
    with pytest.raises(ConfigError) as caught:
        load_config("tiny", ["--task.name=reasoning_gym", f"--task.options={options}"])
    lines = [str(p) for p in caught.value.problems]
    assert len(lines) == 1 and all(f in lines[0] for f in fragments), lines


def test_missing_package_names_the_extra(monkeypatch):
    """Without reasoning-gym the recipe is refused with the pip command of the extra."""
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)
    with pytest.raises(ConfigError) as caught:
        load_config("tiny", ["--task.name=reasoning_gym", "--task.options={dataset = 'gcd'}"])
    assert "pip install 'qarl[reasoning-gym]'" in str(caught.value)
