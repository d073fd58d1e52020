"""Reward functions and their "module:function" loading."""

import pytest

from qarl.tasks import REWARDS, load_reward


def test_math_answer_reward_verifies_equivalent_forms():
    """math-verify: \\frac{1}{2} matches 0.5 both ways; wrong or missing answers score 0.0;
    an unparseable gold answer is None."""
    from qarl.tasks.math_reward import math_answer_reward

    assert math_answer_reward("q", "The answer is 0.5", answer="\\frac{1}{2}") == 1.0
    assert math_answer_reward("q", "so $\\boxed{\\frac{1}{2}}$", answer="0.5") == 1.0
    assert math_answer_reward("q", "The answer is 3", answer="0.5") == 0.0
    assert math_answer_reward("q", "no idea", answer="0.5") == 0.0
    assert math_answer_reward("q", "3", answer="@@") is None
    assert math_answer_reward("q", "3", answer=None) is None


def test_load_reward_builtin_names_and_specs():
    """Built-in names and module:function specs load the same function."""
    from qarl.tasks.addition import addition_reward

    assert load_reward("addition") is addition_reward
    assert load_reward("qarl.tasks.addition:addition_reward") is addition_reward
    assert sorted(REWARDS) == ["addition", "column_addition", "math_answer"]


def test_load_reward_errors_are_specific(tmp_path, monkeypatch):
    """Missing module, missing attribute, non-callable, unknown name and broken imports each
    raise a clear, different error."""
    (tmp_path / "my_rewards.py").write_text("THRESHOLD = 3\ndef good(p, c, **f):\n    return 1.0\n")
    (tmp_path / "broken_rewards.py").write_text("import not_a_real_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_rewards:good")("p", "c") == 1.0
    with pytest.raises(ValueError, match="reward module 'no_such_mod' .* was not found"):
        load_reward("no_such_mod:fn")
    with pytest.raises(ValueError, match="has no attribute 'missing'.*'good'"):
        load_reward("my_rewards:missing")
    with pytest.raises(TypeError, match="is a int, not a function"):
        load_reward("my_rewards:THRESHOLD")
    with pytest.raises(ValueError, match="unknown reward 'bogus'.*module:function"):
        load_reward("bogus")
    with pytest.raises(ValueError, match="must look like"):
        load_reward("my_rewards:")
    with pytest.raises(ImportError, match="importing reward module 'broken_rewards' failed"):
        load_reward("broken_rewards:fn")
