"""Length-collapse and degeneration monitors (the `[monitor]` section).

Each monitor follows one step metric and compares its mean over the last `window` steps (the
current value) with its mean over the first `window` steps (the baseline), from the step where
the run has 2 x window steps (before that it logs nothing):

| monitor | metric | logged (current vs baseline) | alert when |
|---|---|---|---|
| length collapse | response/length_mean | monitor/length_ratio: ratio | < length_drop |
| entropy collapse | policy/entropy | monitor/entropy_ratio: ratio | < entropy_drop |
| degeneration | errors/rep_ngram | monitor/rep_ngram_rise: difference | > repeat_rise |

`monitor/alert` is 1 on a step where any alert fires; the log names the monitor and the
numbers. With `early_stop` the trainer ends the run at the first alert (checkpoint, final
evaluation, `early_stop` in summary.json). The history is part of the checkpoint
(`state()` / `Monitors(section, state)`), so a resumed run keeps its baseline. A metric that
is not finite at a step (e.g. no response with 4 tokens) is left out of its window.
"""

from __future__ import annotations

import math

from qarl.config import MonitorSection

# name -> (metric, logged key, kind): "ratio" monitors alert below, "rise" monitors above
MONITORS = {
    "length collapse": ("response/length_mean", "monitor/length_ratio", "ratio", "length_drop"),
    "entropy collapse": ("policy/entropy", "monitor/entropy_ratio", "ratio", "entropy_drop"),
    "degeneration": ("errors/rep_ngram", "monitor/rep_ngram_rise", "rise", "repeat_rise"),
}


class Monitors:
    def __init__(self, section: MonitorSection, state: dict | None = None):
        self.section = section
        self.history: dict[str, list[float]] = {m: [] for m, *_ in MONITORS.values()}
        self.steps = 0
        if state:
            self.history.update({k: list(v) for k, v in state["history"].items()})
            self.steps = state["steps"]
        self.alert = ""  # the last step's alerts, in words ("" when none fired)

    def state(self) -> dict:
        return {"history": self.history, "steps": self.steps}

    def update(self, metrics: dict[str, float]) -> dict[str, float]:
        """Add one step's metrics; return its monitor/* metrics and set `alert`."""
        self.steps += 1
        window, out, alerts = self.section.window, {}, []
        for metric, *_ in MONITORS.values():
            value = metrics.get(metric)
            # the step count, not the list length, places a window: a skipped value leaves a gap
            self.history[metric].append(value if value is not None and math.isfinite(value)
                                        else math.nan)
        if self.steps < 2 * window:
            self.alert = ""
            return out
        for name, (metric, key, kind, option) in MONITORS.items():
            series = self.history[metric]
            base, now = _mean(series[:window]), _mean(series[-window:])
            if base is None or now is None:
                continue
            if kind == "ratio":
                value = now / base if base > 0 else math.nan
            else:
                value = now - base
            out[key] = value
            threshold = getattr(self.section, option)
            if not threshold or not math.isfinite(value):
                continue
            if (kind == "ratio" and value < threshold) or (kind == "rise" and value > threshold):
                alerts.append(f"{name}: {metric} {now:.4g} over the last {window} steps vs "
                              f"{base:.4g} over the first {window} ("
                              f"{'ratio' if kind == 'ratio' else 'rise'} {value:.3g}, "
                              f"monitor.{option} = {threshold:g})")
        out["monitor/alert"] = float(bool(alerts))
        self.alert = f"step {self.steps}: " + "; ".join(alerts) if alerts else ""
        return out


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None
