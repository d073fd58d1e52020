"""The `[monitor]` section: trends of the samples that tell a collapsing run early."""

from __future__ import annotations

from pydantic import BaseModel, Field

from qarl.config.section import CHECK
from qarl.config.section import SECTION as _SECTION


class MonitorSection(BaseModel):
    """Length collapse, entropy collapse and degeneration monitors (qarl/train/monitors.py):
    each compares the mean of a step metric over the last `window` steps with its mean over
    the first `window` steps, once the run has taken 2 x window steps; a threshold of 0 turns
    that alert off. An alert is logged when it starts and when it clears; the values are
    logged every step either way (monitor/*)."""

    model_config = _SECTION

    window: int = Field(4, ge=1, description="Steps per trend window (the first `window` steps "
                        "are the baseline, the last `window` the current value).")
    length_drop: float = Field(
        0.5, ge=0, le=1,
        description="Length collapse: alert when the current mean response length "
        "(response/length_mean) falls below this fraction of the baseline's.")
    entropy_drop: float = Field(
        0.05, ge=0, le=1,
        description="Entropy collapse: alert when the current policy entropy (policy/entropy) "
        "falls below this fraction of the baseline's.")
    repeat_rise: float = Field(
        0.25, ge=0, le=1,
        description="Degeneration: alert when the current fraction of repeated 4-grams "
        "(errors/rep_ngram) exceeds the baseline's by this much (absolute).")
    reward_hold: float = Field(
        0.9, ge=0, le=1,
        description="Length collapse is judged against the reward: it alerts only where the "
        "reward's current mean (reward/mean) is below its baseline by more than (1 - "
        "reward_hold) of the baseline's size as well. Shorter answers at a steady or rising "
        "reward are a policy learning to be brief; 1 alerts on any fall of the reward, 0 "
        "only when it falls to nothing.",
        json_schema_extra=CHECK)
    early_stop: bool = Field(
        False,
        description="Stop the run at the first alert: the step's checkpoint is saved, the "
        "final evaluation runs and summary.json says why (early_stop). False: alerts are "
        "logged and counted (monitor/alert) only.")
