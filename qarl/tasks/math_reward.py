"""`math_answer`: the reward for math datasets, by math-verify.

Its own module because importing math-verify (it loads sympy) is slow: a reward worker
pays it once at start-up, before any deadline runs, and `import qarl.tasks` does not pay it.
"""

from __future__ import annotations

import logging
from typing import Any

from math_verify import parse, verify

# With timeouts off (see below) math-verify warns once per process that nothing bounds the
# call; the reward runner's deadline does, so the warning is noise in every worker.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def math_answer_reward(prompt: str, completion: str, answer: Any = None, **_: Any) -> float | None:
    """1.0 if math-verify finds the completion's answer equal to `answer`, else 0.0.

    Both sides go through `math_verify.parse` (LaTeX, \\boxed{}, plain expressions), so
    "\\frac{1}{2}" matches "0.5". None when the gold answer is missing or cannot be parsed.
    math-verify's own signal-based timeouts are off: the reward runner's per-call deadline
    bounds the call (and signals fail outside a main thread).
    """
    if answer is None:
        return None
    gold = parse(str(answer), parsing_timeout=None)
    if not gold:
        return None
    prediction = parse(completion, parsing_timeout=None)
    if not prediction:
        return 0.0
    return 1.0 if verify(gold, prediction, timeout_seconds=None) else 0.0
