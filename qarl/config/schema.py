"""The recipe schema: one pydantic model per TOML section, every field described once.

The sections live by what they describe: `run_schema` (run, log), `policy_schema` (model,
quant), `rollout_schema` (rollout, task, eval), `algo_schema` (algo), `train_schema` (train,
sft), `lora_schema` (lora), `monitor_schema` (monitor), `dist_schema` (dist), `compare_schema` (compare). Their
descriptions are the only documentation of the options: `python -m qarl.config --markdown`
turns them into docs/config.md, and the CLI help points there. Checks that span fields or sections live in
`checks.py`; the schema holds only types, defaults and ranges.

Optional fields default to None, meaning "derived" or "absent" (TOML has no null: a saved
config omits it); `load_config` fills the derived ones (run.name, eval.size, eval.temperature,
eval.max_new_tokens).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from qarl.config.algo_schema import AlgoSection, OverlongSection
from qarl.config.compare_schema import CompareSection
from qarl.config.dist_schema import DistSection
from qarl.config.lora_schema import LoraSection
from qarl.config.monitor_schema import MonitorSection
from qarl.config.policy_schema import ModelSection, QuantSection
from qarl.config.rollout_schema import EvalSection, RolloutSection
from qarl.config.task_schema import TaskSection
from qarl.config.run_schema import LogSection, RunSection
from qarl.config.train_schema import SftSection, TrainSection

__all__ = ["AlgoSection", "CompareSection", "DistSection", "EvalSection", "LogSection", "LoraSection",
           "ModelSection", "MonitorSection", "OPTIONAL_SECTIONS", "OverlongSection", "QuantSection",
           "RolloutSection", "RunConfig", "RunSection", "SECTIONS", "SftSection", "TaskSection",
           "TrainSection"]


class RunConfig(BaseModel):
    """A whole recipe. Sections may be omitted from a TOML file; their defaults apply."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection = Field(default_factory=ModelSection)
    quant: QuantSection = Field(default_factory=QuantSection)
    rollout: RolloutSection = Field(default_factory=RolloutSection)
    task: TaskSection = Field(default_factory=TaskSection)
    algo: AlgoSection = Field(default_factory=AlgoSection)
    train: TrainSection
    eval: EvalSection = Field(default_factory=EvalSection)
    sft: SftSection = Field(default_factory=SftSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    log: LogSection = Field(default_factory=LogSection)
    monitor: MonitorSection = Field(default_factory=MonitorSection)
    dist: DistSection = Field(default_factory=DistSection)
    compare: CompareSection | None = None  # optional: None when the recipe has no [compare]


# section name -> model, in recipe order; the loader validates each on its own so that
# problems in one section do not hide problems in another.
SECTIONS: dict[str, type[BaseModel]] = {
    **{name: field.annotation for name, field in RunConfig.model_fields.items()},
    "compare": CompareSection,
}
# Sections that stay None when the recipe leaves them out (no defaults filled in).
OPTIONAL_SECTIONS = frozenset({"compare"})
