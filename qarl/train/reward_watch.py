"""What a run does with rewards that fail: no failure is silent.

The reward runner (qarl.tasks.runner) turns every call into an outcome; an `error` (the reward
raised, returned something that is not a number, or its worker died) or a `timeout` scores
None, never 0, and is counted per step (`reward/error`, `reward/timeout`). `RewardWatch` reads
each batch's outcomes, the training steps' and the evaluations':

- the first time a message is seen (the exception and where it was raised, the reward's last
  frame) it is logged once and appended to `reward_errors.txt` in the run folder, with where
  it first happened; later calls with the same message only count;
- a batch whose failed fraction passes `task.reward_error_warn` starts a warning, logged once
  with the counts and the first message, and one line more when a batch is back under it;
- when every call of the run's first batch failed (the step-0 evaluation's, or the first
  step's), nothing could have been learned: the run stops with `RewardsFailed` (a UserError:
  one message, exit status 2) naming the reward and its first error, before any update.
"""

from __future__ import annotations

from pathlib import Path

from qarl.errors import UserError
from qarl.tasks import RewardResult

ERRORS_FILE = "reward_errors.txt"


class RewardsFailed(UserError):
    """Every reward call of the run's first batch failed."""


class RewardWatch:
    """The reward failures of one run (module docstring): `spec` names the reward, `run_dir`
    keeps its errors file, `warn_fraction` is task.reward_error_warn."""

    def __init__(self, spec: str, run_dir: Path, warn_fraction: float):
        self.spec, self.path, self.warn_fraction = spec, Path(run_dir) / ERRORS_FILE, warn_fraction
        self.counts: dict[str, int] = {}  # message -> calls that failed with it
        self.warning = False  # in a warning episode
        self.scored = False  # a call of this run has returned a reward (or None)
        self.lines: list[str] = []  # to log, taken by `take_lines`

    def observe(self, result: RewardResult, where: str) -> None:
        """Read one batch's outcomes (`where`: "step 3", "the evaluation at step 0")."""
        failed = result.counts["error"] + result.counts["timeout"]
        calls = len(result.outcomes)
        first = None
        for index in sorted(result.errors):
            message = result.errors[index]
            first = first or message
            if message not in self.counts:
                self.counts[message] = 0
                self.lines.append(f"{where}: the reward {self.spec!r} failed: {message}")
                with self.path.open("a") as f:
                    f.write(f"{where}: {message}\n")
            self.counts[message] += 1
        if calls and failed == calls and not self.scored:
            raise RewardsFailed(
                f"every one of the {calls} reward calls of {where} failed "
                f"({result.counts['error']} errors, {result.counts['timeout']} timeouts), so "
                f"nothing can be learned: the reward {self.spec!r} gave {first}. Fix it (each "
                f"distinct error is in {self.path}); a reward that cannot score a completion "
                "returns None, and a slow one needs a larger task.reward_timeout_s")
        self.scored = self.scored or failed < calls
        over = calls > 0 and failed / calls > self.warn_fraction
        if over and not self.warning:
            self.lines.append(
                f"{where}: {failed} of {calls} reward calls failed ({result.counts['error']} "
                f"errors, {result.counts['timeout']} timeouts; task.reward_error_warn = "
                f"{self.warn_fraction:g}): they score None and leave their group's baseline; "
                f"the errors are in {self.path}")
        elif self.warning and not over:
            self.lines.append(f"{where}: reward failures back under task.reward_error_warn "
                              f"({failed} of {calls})")
        self.warning = over

    def take_lines(self) -> list[str]:
        """The lines to log since the last call, once each."""
        lines, self.lines = self.lines, []
        return lines
