"""Length-collapse, entropy-collapse and degeneration monitors (the `[monitor]` section).

Each monitor follows one step metric and compares its mean over the last `window` steps (the
current value) with its mean over the first `window` steps (the baseline), from the step where
the run has 2 x window steps (before that it logs nothing):

| monitor | metric | logged (current vs baseline) | alert when |
|---|---|---|---|
| length collapse | response/length_mean | monitor/length_ratio: ratio | < length_drop, and the reward fell |
| entropy collapse | policy/entropy | monitor/entropy_ratio: ratio | < entropy_drop |
| degeneration | errors/rep_ngram | monitor/rep_ngram_rise: difference | > repeat_rise |

A shorter answer is a collapse only where the reward fell with it: the length alert also
needs the reward's current mean (reward/mean, logged as monitor/reward_ratio) below
`reward_hold` x its baseline; a policy that learns to answer in fewer tokens while its reward
holds or rises is not collapsing.

An alert is an episode: the log says when it starts (with the numbers) and when it clears,
never at the steps in between. `monitor/alert` is 1 at every step where any alert is on. With
`early_stop` the trainer ends the run when the first alert starts (checkpoint, final
evaluation, `early_stop` in summary.json). The history and the alerts that are on are part of
the checkpoint (`state()` / `Monitors(section, state)`), so a resumed run keeps its baseline
and its episodes. A metric that is not finite at a step (e.g. no response with 4 tokens) is
left out of its window.
"""

from __future__ import annotations

import math

from qarl.config import MonitorSection

REWARD = "reward/mean"
# name -> (metric, logged key, kind, option): "ratio" monitors alert below, "rise" above
MONITORS = {
    "length collapse": ("response/length_mean", "monitor/length_ratio", "ratio", "length_drop"),
    "entropy collapse": ("policy/entropy", "monitor/entropy_ratio", "ratio", "entropy_drop"),
    "degeneration": ("errors/rep_ngram", "monitor/rep_ngram_rise", "rise", "repeat_rise"),
}
FOLLOWED = [m for m, *_ in MONITORS.values()] + [REWARD]


class Monitors:
    def __init__(self, section: MonitorSection, state: dict | None = None):
        self.section = section
        self.history: dict[str, list[float]] = {m: [] for m in FOLLOWED}
        self.steps = 0
        self.active: dict[str, str] = {}  # monitor name -> the alert's sentence, while it is on
        if state:
            # a checkpoint holds null where a value was not finite (qarl.jsonio)
            self.history.update({k: [math.nan if v is None else v for v in values]
                                 for k, values in state["history"].items()})
            self.steps = state["steps"]
            self.active = dict(state.get("active", {}))
        self.alert = ""  # what started or cleared at the last step, in words ("" when nothing)
        self.started = False  # an alert started at the last step

    def state(self) -> dict:
        return {"history": self.history, "steps": self.steps, "active": self.active}

    def update(self, metrics: dict[str, float]) -> dict[str, float]:
        """Add one step's metrics; return its monitor/* metrics and set `alert` (the alerts
        that started or cleared at this step) and `started`."""
        self.steps += 1
        window, out = self.section.window, {}
        for metric in FOLLOWED:
            value = metrics.get(metric)
            # the step count, not the list length, places a window: a skipped value leaves a gap
            self.history[metric].append(value if value is not None and math.isfinite(value)
                                        else math.nan)
        self.alert, self.started = "", False
        if self.steps < 2 * window:
            return out
        reward = _trend(self.history[REWARD], window)
        if reward is not None:
            out["monitor/reward_ratio"] = reward[2]
        firing: dict[str, str] = {}
        for name, (metric, key, kind, option) in MONITORS.items():
            trend = _trend(self.history[metric], window, kind)
            if trend is None:
                continue
            base, now, value = trend
            out[key] = value
            threshold = getattr(self.section, option)
            if not threshold or not math.isfinite(value):
                continue
            if (kind == "ratio" and value < threshold) or (kind == "rise" and value > threshold):
                if name == "length collapse" and not self._reward_fell(reward):
                    continue  # shorter answers at a steady or rising reward
                firing[name] = (f"{name}: {metric} {now:.4g} over the last {window} steps vs "
                                f"{base:.4g} over the first {window} ("
                                f"{'ratio' if kind == 'ratio' else 'rise'} {value:.3g}, "
                                f"monitor.{option} = {threshold:g})")
        started = {n: s for n, s in firing.items() if n not in self.active}
        cleared = [n for n in self.active if n not in firing]
        self.active = firing
        out["monitor/alert"] = float(bool(firing))
        events = [f"{sentence} (alert)" for sentence in started.values()]
        events += [f"{name}: cleared" for name in cleared]
        self.alert = f"step {self.steps}: " + "; ".join(events) if events else ""
        self.started = bool(started)
        return out

    def _reward_fell(self, reward: tuple[float, float, float] | None) -> bool:
        """The reward's current mean fell below its baseline by more than (1 - reward_hold)
        of the baseline's size (no reward logged: judged on length alone)."""
        if reward is None:
            return True
        base, now, _ = reward
        return now < base - (1 - self.section.reward_hold) * abs(base)


def _trend(series: list[float], window: int, kind: str = "ratio"
           ) -> tuple[float, float, float] | None:
    """(baseline, current, ratio or rise) of `series` over its first and last `window`
    values, or None where either window holds no finite value."""
    base, now = _mean(series[:window]), _mean(series[-window:])
    if base is None or now is None:
        return None
    if kind == "ratio":
        return base, now, (now / base if base > 0 else math.nan)
    return base, now, now - base


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None
