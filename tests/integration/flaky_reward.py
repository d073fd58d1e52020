"""A user reward for the trainer tests: raises when the answer is a multiple of 3, hangs when
it is one more than a multiple of 3, scores normally otherwise (so every step sees all three)."""

import time


def reward(prompt, completion, answer=None, **_):
    if int(answer) % 3 == 0:
        raise ValueError("this reward cannot handle multiples of three")
    if int(answer) % 3 == 1:
        time.sleep(30)
    return float(completion.strip() == str(answer))
