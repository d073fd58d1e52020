"""`addition`: arithmetic questions with one integer answer and a difficulty knob.

"What is 3 + 5? Answer with just the number." Difficulty: `digits` per operand (1 means 0..9,
d >= 2 means exactly d digits), `operands` (2..6) and `operators` (any of "+-*", each operator
drawn uniformly; usual precedence: * before + and -). The default, one-digit two-operand
addition, is the task SmolLM2-135M-Instruct is trained on from scratch.

Answer rule (`extract_answer`), documented because the reward depends on it:
  1. if the completion has an explicit marker ("answer", "answer is", "answer:", "=" or "is")
     followed by a number, the number after the LAST such marker is the answer;
  2. otherwise the LAST number in the completion is the answer;
  3. no number at all: reward 0.0 (the completion is scorable, just wrong).
Numbers: an optional minus sign (only when not glued to a preceding digit or letter, so
"5-3" reads 5 and 3), digits with optional thousands commas ("1,234"), optional decimals.
A decimal counts only if it is integral ("8.0" == 8, "8.5" is wrong). Words ("eight") do not
count. The reward is None only when the gold answer itself is not an integer.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

from qarl.tasks.base import Example, check_options, sample_split

_NUMBER = r"(?<![\w.])-?\d{1,3}(?:,\d{3})+(?:\.\d+)?(?![\d,])|(?<![\w.,])-?\d+(?:\.\d+)?"
NUMBER_RE = re.compile(_NUMBER)
_MARKER_RE = re.compile(r"(?:\banswer\b\s*(?:is\b)?\s*[:=]?|=|\bis\b)\s*\**\s*(?=-?\d)", re.I)

_OPERATORS = "+-*"
_MAX_DIGITS = 9
_MAX_OPERANDS = 6
_MAX_ENUMERATE = 100_000  # problem spaces up to this size are enumerated, see sample_split


def parse_integer(token: str) -> int | None:
    """The integer a number token denotes ("1,234" -> 1234, "8.0" -> 8), None if not integral."""
    text = token.replace(",", "")
    if "." in text:
        whole, frac = text.split(".", 1)
        if frac.strip("0"):
            return None
        text = whole
    return int(text)


def extract_answer(completion: str) -> int | None:
    """The integer answer of a completion by the rule in the module docstring; None if none.

    A non-integral final number ("8.5") gives None: there is no integer answer.
    """
    markers = list(_MARKER_RE.finditer(completion))
    if markers:
        match = NUMBER_RE.match(completion, markers[-1].end())
        if match:
            return parse_integer(match.group())
    numbers = NUMBER_RE.findall(completion)
    return parse_integer(numbers[-1]) if numbers else None


def integer_reward(completion: str, answer: Any) -> float | None:
    """1.0 if the completion's answer equals the integer gold `answer`, else 0.0; None if the
    gold answer is not an integer."""
    try:
        gold = int(str(answer).strip())
    except ValueError:
        return None
    return 1.0 if extract_answer(completion) == gold else 0.0


def addition_reward(prompt: str, completion: str, answer: Any = None, **_: Any) -> float | None:
    """Reward of the `addition` task (see the module docstring for the answer rule)."""
    return integer_reward(completion, answer)


def evaluate(operands: tuple[int, ...], ops: tuple[str, ...]) -> int:
    """Value of operands[0] ops[0] operands[1] ... with * binding tighter than + and -."""
    # Fold each run of products into one term, then sum the signed terms.
    terms, signs = [operands[0]], [1]
    for op, value in zip(ops, operands[1:]):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms))


class AdditionTask:
    """Procedural arithmetic; see the module docstring."""

    reward_spec = "qarl.tasks.addition:addition_reward"

    def __init__(
        self,
        digits: int = 1,
        operands: int = 2,
        operators: str = "+",
        eval_fraction: float = 0.2,
        system: str | None = None,
    ) -> None:
        problems = []
        if not (isinstance(digits, int) and 1 <= digits <= _MAX_DIGITS):
            problems.append(f"digits must be an integer in [1, {_MAX_DIGITS}], got {digits!r}")
        if not (isinstance(operands, int) and 2 <= operands <= _MAX_OPERANDS):
            problems.append(
                f"operands must be an integer in [2, {_MAX_OPERANDS}], got {operands!r}"
            )
        if not (isinstance(operators, str) and operators and set(operators) <= set(_OPERATORS)):
            problems.append(
                f"operators must be a non-empty subset of {_OPERATORS!r}, got {operators!r}"
            )
        if not (isinstance(eval_fraction, float | int) and 0 < eval_fraction < 1):
            problems.append(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
        check_options("addition", problems)
        self.digits, self.num_operands = digits, operands
        self.operators = "".join(sorted(set(operators), key=_OPERATORS.index))
        self.eval_fraction, self.system = float(eval_fraction), system
        self.name = "addition"

    def _range(self) -> range:
        return range(0, 10) if self.digits == 1 else range(10 ** (self.digits - 1), 10**self.digits)

    def _draw(self, rng: random.Random) -> tuple[tuple[int, ...], tuple[str, ...]]:
        r = self._range()
        values = tuple(rng.randrange(r.start, r.stop) for _ in range(self.num_operands))
        ops = tuple(rng.choice(self.operators) for _ in range(self.num_operands - 1))
        return values, ops

    def _enumerate(self):
        """Every problem, or None when there are more than _MAX_ENUMERATE of them."""
        n_ops = self.num_operands - 1
        size = len(self._range()) ** self.num_operands * len(self.operators) ** n_ops
        if size > _MAX_ENUMERATE:
            return None
        all_ops = list(itertools.product(self.operators, repeat=n_ops))
        return lambda: itertools.product(
            itertools.product(self._range(), repeat=self.num_operands), all_ops
        )

    @staticmethod
    def _question(problem: tuple[tuple[int, ...], tuple[str, ...]]) -> str:
        values, ops = problem
        text = str(values[0])
        for op, value in zip(ops, values[1:]):
            text += f" {op} {value}"
        return text

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """n problems of `split`, deterministic in (options, split, n, seed).

        Small spaces (one-digit addition has 100 ordered pairs) are enumerated: about
        eval_fraction of the pairs are eval-only, fixed by hash; each split cycles through its
        own problems in a seed-dependent order (so n > split size repeats problems).
        """
        chosen = sample_split(
            split, n, seed, self._draw, self._question, self.eval_fraction, self._enumerate()
        )
        return [
            Example(
                prompt=f"What is {self._question(p)}? Answer with just the number.",
                answer=str(evaluate(*p)),
                system=self.system,
            )
            for p in chosen
        ]

    def reward(self, prompt: str, completion: str, **fields: Any) -> float | None:
        return addition_reward(prompt, completion, **fields)

    def reference_completion(self, example: Example) -> str:
        """The gold completion: the bare number."""
        return example.answer
