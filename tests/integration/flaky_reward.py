"""A user reward for the trainer tests: raises on prompts about 7, hangs on prompts about 9."""

import time


def reward(prompt, completion, answer=None, **_):
    if "7" in prompt:
        raise ValueError("this reward cannot handle sevens")
    if "9" in prompt:
        time.sleep(30)
    return float(completion.strip() == str(answer))
