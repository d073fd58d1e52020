"""`column_addition`: long, structured answers with a known grammar.

"Add 4821 and 397 column by column." The answer is one line per column, ones first, then the
result:

    d0: 1+7+0=8 carry 0
    d1: 2+9+0=11 carry 1
    d2: 8+3+1=12 carry 1
    d3: 4+0+1=5 carry 0
    answer: 5218

Column line i: the i-th digit (from the right, 0 when an operand is shorter) of each operand,
then the carry into the column, "=", the column sum, "carry", the sum // 10. The written digit
of the result is the sum % 10; a final carry becomes the leading digits of the answer.

Grammar (`grammar_ok`): exactly the lines `d<i>: <digit>(+<digit>)*+<int>=<int> carry <int>`
for i = 0, 1, 2, ... in order, then `answer: <int>`, nothing else (surrounding whitespace
allowed). It is syntax only: a wrong sum still follows the grammar; `garbled` counts responses
that leave it.

Reward: 1.0 when the number on the last `answer:` line equals the sum, else 0.0 (also when no
`answer:` line exists). Never None: every example has an integer answer. The column lines are
not scored: the reward is the final answer, the grammar is a separate diagnostic.
"""

from __future__ import annotations

import random
import re
from typing import Any

from qarl.tasks.addition import NUMBER_RE, parse_integer
from qarl.tasks.base import Example, check_options, sample_split

_COLUMN_RE = re.compile(r"d(\d+): \d(?:\+\d)+\+\d+=\d+ carry \d+")
_ANSWER_LINE_RE = re.compile(r"answer: -?\d+")
_ANSWER_RE = re.compile(r"answer:\s*", re.I)
_MAX_DIGITS = 30
_MAX_OPERANDS = 5

_FORMAT_HELP = (
    "Work from the ones digit. Write one line per column in the form "
    "'d<i>: <digits>+<carry in>=<sum> carry <carry out>', then a last line 'answer: <result>'. "
    "Example for 57 and 68:\nd0: 7+8+0=15 carry 1\nd1: 5+6+1=12 carry 1\nanswer: 125"
)


def column_lines(operands: tuple[int, ...]) -> list[str]:
    """The gold column lines of operands (non-negative integers), ones column first."""
    width = max(len(str(v)) for v in operands)
    padded = [str(v).zfill(width)[::-1] for v in operands]  # ones digit first
    lines, carry = [], 0
    for i in range(width):
        digits = [p[i] for p in padded]
        total = sum(int(d) for d in digits) + carry
        lines.append(f"d{i}: {'+'.join(digits)}+{carry}={total} carry {total // 10}")
        carry = total // 10
    return lines


def grammar_ok(completion: str) -> bool:
    """True iff the completion is column lines d0, d1, ... in order and then an answer line."""
    lines = completion.strip().split("\n")
    if len(lines) < 2 or not _ANSWER_LINE_RE.fullmatch(lines[-1].strip()):
        return False
    for i, line in enumerate(lines[:-1]):
        match = _COLUMN_RE.fullmatch(line.strip())
        if match is None or int(match.group(1)) != i:
            return False
    return True


def extract_column_answer(completion: str) -> int | None:
    """The integer after the last "answer:" (case-insensitive), None if there is none."""
    markers = list(_ANSWER_RE.finditer(completion))
    if not markers:
        return None
    match = NUMBER_RE.match(completion, markers[-1].end())
    return parse_integer(match.group()) if match else None


def column_addition_reward(prompt: str, completion: str, answer: Any = None, **_: Any) -> float:
    """Reward of `column_addition`: 1.0 iff the last `answer:` number equals `answer`."""
    try:
        gold = int(str(answer).strip())
    except ValueError:
        raise ValueError(
            f"column_addition needs an integer gold answer, got {answer!r}; "
            "score column_addition completions with the task's own examples"
        ) from None
    return 1.0 if extract_column_answer(completion) == gold else 0.0


class ColumnAdditionTask:
    """Multi-digit addition answered column by column; see the module docstring.

    The first operand has exactly `digits` digits, the others between 1 and `digits`.
    """

    reward_spec = "qarl.tasks.column_addition:column_addition_reward"

    def __init__(
        self,
        digits: int = 4,
        operands: int = 2,
        eval_fraction: float = 0.2,
        system: str | None = None,
    ) -> None:
        problems = []
        if not (isinstance(digits, int) and 2 <= digits <= _MAX_DIGITS):
            problems.append(f"digits must be an integer in [2, {_MAX_DIGITS}], got {digits!r}")
        if not (isinstance(operands, int) and 2 <= operands <= _MAX_OPERANDS):
            problems.append(
                f"operands must be an integer in [2, {_MAX_OPERANDS}], got {operands!r}"
            )
        if not (isinstance(eval_fraction, float | int) and 0 < eval_fraction < 1):
            problems.append(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
        check_options("column_addition", problems)
        self.digits, self.num_operands = digits, operands
        self.eval_fraction, self.system = float(eval_fraction), system
        self.name = "column_addition"

    def _draw(self, rng: random.Random) -> tuple[int, ...]:
        first = rng.randrange(10 ** (self.digits - 1), 10**self.digits)
        rest = []
        for _ in range(self.num_operands - 1):
            length = rng.randint(1, self.digits)
            rest.append(rng.randrange(0 if length == 1 else 10 ** (length - 1), 10**length))
        return (first, *rest)

    @staticmethod
    def _key(operands: tuple[int, ...]) -> str:
        return " + ".join(map(str, operands))

    def examples(self, split: str, n: int, seed: int) -> list[Example]:
        """n problems of `split`, deterministic in (options, split, n, seed); splits are
        disjoint by a hash of the operands."""
        chosen = sample_split(split, n, seed, self._draw, self._key, self.eval_fraction)
        out = []
        for operands in chosen:
            listed = ", ".join(map(str, operands[:-1])) + f" and {operands[-1]}"
            out.append(
                Example(
                    prompt=f"Add {listed} column by column. {_FORMAT_HELP}",
                    answer=str(sum(operands)),
                    system=self.system,
                    fields={"operands": list(operands)},
                )
            )
        return out

    def reward(self, prompt: str, completion: str, **fields: Any) -> float:
        return column_addition_reward(prompt, completion, **fields)

    def grammar_ok(self, completion: str) -> bool:
        return grammar_ok(completion)

    def reference_completion(self, example: Example) -> str:
        """The gold column lines and answer line for an example of this task."""
        operands = tuple(int(v) for v in example.fields["operands"])
        return "\n".join([*column_lines(operands), f"answer: {sum(operands)}"])
