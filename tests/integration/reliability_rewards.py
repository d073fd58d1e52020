"""Rewards for tests/integration/test_reliability.py, imported by the reward workers.

`slow`: the addition task's own reward; when $QARL_TEST_SLOW_REWARD names a file that does
not exist yet, the first call creates it and sleeps 60 s (a run stuck in its reward phase).
`misbehaving`: by the gold answer mod 5: 0 sleeps past any deadline, 1 raises, 2 kills its
worker (os._exit), 3 returns a string, 4 scores like `slow`.
`unscorable`: always None.
`batched`: a batched reward (task.reward_batch) that scores like `slow`, except that its
second call (the first training step's, after the evaluation before step 1) raises and its
third sleeps past any deadline; calls are counted in $QARL_TEST_BATCH_CALLS, a folder.
"""

import os
import time
from pathlib import Path

from qarl.tasks.addition import addition_reward

BEHAVIOURS = ("hang", "raise", "exit", "string", "ok")  # index: int(answer) % 5


def slow(prompt, completion, answer=None, **fields):
    marker = os.environ.get("QARL_TEST_SLOW_REWARD")
    if marker and not Path(marker).exists():
        Path(marker).touch()
        time.sleep(60)
    return addition_reward(prompt, completion, answer)


def misbehaving(prompt, completion, answer=None, **fields):
    behaviour = BEHAVIOURS[int(answer) % 5]
    if behaviour == "hang":
        time.sleep(60)
    if behaviour == "raise":
        raise ValueError("a planted reward failure")
    if behaviour == "exit":
        os._exit(3)
    if behaviour == "string":
        return "high"
    return addition_reward(prompt, completion, answer)


def unscorable(prompt, completion, **fields):
    return None


def batched(prompts, completions, answer, **fields):
    calls = Path(os.environ["QARL_TEST_BATCH_CALLS"])
    number = len(list(calls.iterdir())) + 1
    (calls / str(number)).touch()
    if number == 2:
        raise ValueError("a planted batch failure")
    if number == 3:
        time.sleep(60)
    return [addition_reward(p, c, a) for p, c, a in zip(prompts, completions, answer)]
