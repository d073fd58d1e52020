"""The reward runner: every call ends in one counted outcome and the pool survives."""

import os
import time

import pytest

from qarl.tasks import AdditionTask, RewardRunner

USER_REWARDS = '''
import os, time

def reward(prompt, completion, behavior="ok", **fields):
    if behavior == "ok":
        return float(len(completion))
    if behavior == "none":
        return None
    if behavior == "raise":
        raise ZeroDivisionError("planted failure")
    if behavior == "hang":
        time.sleep(60)
    if behavior == "slow":
        time.sleep(2)
        return 1.0
    if behavior == "str":
        return "high"
    if behavior == "nan":
        return float("nan")
    if behavior == "die":
        os._exit(3)

def pid(prompt, completion, **fields):
    return float(os.getpid())
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "qarl_test_user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "qarl_test_user_rewards"


def _calls(*behaviors):
    return [("p", "abc", {"behavior": b}) for b in behaviors]


def test_outcomes_are_counted_and_the_runner_survives(user_module):
    """ok / unscorable / error (raise, bad value, dead worker) / timeout are each counted,
    their rewards are None (never 0), messages are kept, and the runner scores afterwards."""
    with RewardRunner(f"{user_module}:reward", num_workers=2, timeout_s=0.5) as runner:
        result = runner.score(_calls("ok", "hang", "raise", "none", "str", "nan", "die", "ok"))
        assert result.outcomes == ["ok", "timeout", "error", "unscorable", "error", "error",
                                   "error", "ok"]
        assert result.rewards == [3.0, None, None, None, None, None, None, 3.0]
        assert result.counts == {"ok": 2, "unscorable": 1, "error": 4, "timeout": 1}
        assert "ZeroDivisionError: planted failure" in result.errors[2]
        assert "returned 'high'" in result.errors[4] and "returned nan" in result.errors[5]
        assert "worker died (exit code 3)" in result.errors[6]
        assert "no answer within 0.5 s" in result.errors[1]
        assert runner.workers_replaced == 2
        again = runner.score(_calls("ok", "ok", "ok"))
        assert again.counts["ok"] == 3 and runner.num_workers == 2


def test_a_hang_does_not_block_the_other_worker(user_module):
    """While one worker hangs until its deadline, the other scores the remaining calls."""
    with RewardRunner(f"{user_module}:reward", num_workers=2, timeout_s=0.5) as runner:
        start = time.monotonic()
        result = runner.score(_calls("hang", *["ok"] * 20))
        assert result.counts == {"ok": 20, "unscorable": 0, "error": 0, "timeout": 1}
        assert time.monotonic() - start < 5.0


def test_workers_persist_between_batches_and_close_cleanly(user_module):
    """The same worker processes serve consecutive batches; close() ends them all."""
    runner = RewardRunner(f"{user_module}:pid", num_workers=2, timeout_s=5)
    first = set(runner.score([("p", "c", {})] * 8).rewards)
    second = set(runner.score([("p", "c", {})] * 8).rewards)
    assert first | second <= {float(w.process.pid) for w in runner._workers}
    assert os.getpid() not in {int(p) for p in first}
    processes = [w.process for w in runner._workers]
    runner.close()
    runner.close()
    assert all(p.poll() is not None for p in processes)
    with pytest.raises(RuntimeError, match="closed"):
        runner.score([("p", "c", {})])


def test_builtin_task_rewards_run_in_workers():
    """A built-in task's reward_spec scores its reference completions 1.0 in the workers."""
    task = AdditionTask()
    examples = task.examples("train", 16, seed=0)
    calls = [(e.prompt, task.reference_completion(e), e.reward_kwargs()) for e in examples]
    calls.append((examples[0].prompt, "no number here", examples[0].reward_kwargs()))
    with RewardRunner(task.reward_spec, num_workers=1, timeout_s=5) as runner:
        result = runner.score(calls)
    assert result.rewards == [1.0] * 16 + [0.0]


def test_inline_mode_counts_errors_without_processes(user_module):
    """num_workers=0 scores in this process and still counts exceptions as errors."""
    with RewardRunner(f"{user_module}:reward", num_workers=0) as runner:
        result = runner.score(_calls("ok", "raise", "none"))
    assert result.outcomes == ["ok", "error", "unscorable"] and runner.num_workers == 0


def test_bad_spec_and_settings_fail_at_construction(user_module):
    """A reward that cannot load in the worker, or bad settings, raise before any scoring."""
    with pytest.raises(RuntimeError, match="could not load.*has no attribute"):
        RewardRunner(f"{user_module}:nope", num_workers=1)
    with pytest.raises(ValueError, match="num_workers must be.*timeout_s must be"):
        RewardRunner("addition", num_workers=-1, timeout_s=0)


def test_works_from_a_script_without_a_main_guard(tmp_path):
    """A script that builds a runner at top level (no `if __name__ == "__main__"`) works:
    workers never re-import the parent's __main__."""
    import subprocess
    import sys

    script = tmp_path / "train_script.py"
    script.write_text(
        "from qarl.tasks import RewardRunner\n"
        "with RewardRunner('addition', num_workers=1, timeout_s=5) as r:\n"
        "    print(r.score([('q', '4', {'answer': '4'})]).rewards)\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[1.0]"


class _Stop(Exception):
    pass


def _stop_after(seconds):
    """A stop_check that raises once `seconds` have passed."""
    deadline = time.monotonic() + seconds

    def check():
        if time.monotonic() > deadline:
            raise _Stop()

    return check


def test_a_stopped_batch_ends_at_once_and_does_not_leak_into_the_next(user_module):
    """A stop_check that raises while a reward hangs ends score() within a few polls (not at
    the call's deadline); the next batch gets only its own answers (the worker left busy is
    replaced), and close() does not wait for a busy worker."""
    runner = RewardRunner(f"{user_module}:reward", num_workers=1, timeout_s=30)
    runner.stop_check = _stop_after(0.3)
    start = time.monotonic()
    with pytest.raises(_Stop):
        runner.score(_calls("hang", "ok"))
    assert time.monotonic() - start < 2.0
    runner.stop_check = lambda: None
    result = runner.score(_calls("ok", "none"))
    assert result.outcomes == ["ok", "unscorable"] and result.rewards == [3.0, None]
    assert result.workers_replaced == 0 and runner.workers_replaced == 1
    runner.stop_check = _stop_after(0.3)
    with pytest.raises(_Stop):
        runner.score(_calls("hang"))
    start = time.monotonic()
    runner.close()
    assert time.monotonic() - start < 2.0


def test_fields_travel_as_json(user_module):
    """Calls and answers cross the pipe as JSON: a call whose fields are not JSON values is
    an `error` outcome that names the problem (in worker and inline mode alike), the other
    calls of the batch are scored, and a batch counts the workers it replaced."""
    bad = ("p", "abc", {"behavior": "ok", "when": object()})
    for workers in (1, 0):
        with RewardRunner(f"{user_module}:reward", num_workers=workers, timeout_s=5) as runner:
            result = runner.score([bad, *_calls("ok")])
            assert result.outcomes == ["error", "ok"] and result.rewards == [None, 3.0]
            assert "not JSON values" in result.errors[0]
    with RewardRunner(f"{user_module}:reward", num_workers=1, timeout_s=5) as runner:
        assert runner.score(_calls("die", "ok", "die")).workers_replaced == 2


def test_a_worker_whose_trainer_was_killed_ends_quietly(user_module, tmp_path):
    """The trainer SIGKILLed while its worker is inside a call: the worker finishes the call,
    finds the pipe closed and exits without a traceback (it prints nothing); its stderr,
    shared with the dead trainer, closes within seconds."""
    import subprocess
    import sys

    script = (
        "import os, signal, sys, threading\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from qarl.tasks import RewardRunner\n"
        f"runner = RewardRunner({user_module + ':reward'!r}, num_workers=1, timeout_s=30)\n"
        "threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()\n"
        "runner.score([('p', 'abc', {'behavior': 'slow'})])\n"
    )
    trainer = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    start = time.monotonic()
    err = trainer.stderr.read()  # until the worker, which shares it, is gone too
    trainer.wait()
    assert trainer.returncode == -9
    assert err == "" and time.monotonic() - start < 20, err



BATCHED_REWARDS = '''
import os, time

def batched(prompts, completions, weight=None, mode=None, **fields):
    assert isinstance(prompts, list) and isinstance(completions, list)
    if mode is not None and mode[0] == "raise":
        raise RuntimeError("planted batch failure")
    if mode is not None and mode[0] == "hang":
        time.sleep(60)
    if mode is not None and mode[0] == "short":
        return [1.0]
    if mode is not None and mode[0] == "die":
        os._exit(4)
    weight = weight or [None] * len(completions)
    return [None if c == "none" else "bad" if c == "bad" else len(c) * (w or 1.0)
            for c, w in zip(completions, weight)]
'''


@pytest.fixture
def batched_reward(tmp_path, monkeypatch):
    (tmp_path / "qarl_test_batched_rewards.py").write_text(BATCHED_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "qarl_test_batched_rewards:batched"


@pytest.mark.parametrize("workers", [0, 2])
def test_batched_reward_gets_lists_and_judges_each_value(batched_reward, workers):
    """A batched reward is called once with every prompt, completion and field as lists
    (None where a call lacks the field); each returned value gets its own outcome; a call
    whose fields are not JSON is an error without spoiling the batch."""
    calls = [("p", "abc", {"weight": 2.0}), ("p", "none", {}), ("p", "bad", {"weight": 1.0}),
             ("p", "ab", {"weight": object()}), ("p", "abcd", {})]
    with RewardRunner(batched_reward, num_workers=workers, timeout_s=5, batched=True) as runner:
        result = runner.score(calls)
    assert result.outcomes == ["ok", "unscorable", "error", "error", "ok"]
    assert result.rewards == [6.0, None, None, None, 4.0]
    assert "returned 'bad'" in result.errors[2] and "not JSON values" in result.errors[3]


@pytest.mark.parametrize("mode, outcome, words, replaced", [
    ("raise", "error", "RuntimeError: planted batch failure", 0),
    ("hang", "timeout", "no answer within 0.5 s", 1),
    ("short", "error", "returned 1 values for 3 completions", 0),
    ("die", "error", "worker died (exit code 4)", 1),
])
def test_a_failed_batch_fails_every_call_and_the_runner_survives(batched_reward, mode, outcome,
                                                                  words, replaced):
    """A batch call that raises, hangs past the deadline, returns the wrong number of values
    or kills its worker gives every call of the batch that outcome and message (counted per
    call, reward None); the worker is replaced where it was killed or died, and the runner
    scores the next batch."""
    with RewardRunner(batched_reward, num_workers=1, timeout_s=0.5, batched=True) as runner:
        result = runner.score([("p", "abc", {"mode": mode})] * 3)
        assert result.outcomes == [outcome] * 3 and result.rewards == [None] * 3
        assert result.counts[outcome] == 3 and result.workers_replaced == replaced
        assert all(words in result.errors[i] for i in range(3))
        again = runner.score([("p", "ab", {"mode": "ok"})] * 2)
        assert again.outcomes == ["ok"] * 2 and again.rewards == [2.0] * 2
