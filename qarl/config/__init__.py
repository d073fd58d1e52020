"""Typed, validated recipes: TOML sections -> pydantic models, every problem reported at once.

    from qarl.config import load_config, save_resolved
    config = load_config("recipes/default.toml", ["--train.steps=5"])   # or load_config(None)
    config.rollout.batch_size, config.algo.loss_params
    save_resolved(config, run_folder)                                    # run_folder/config.toml

Every option and its help live in `schema.py`; docs/config.md is generated from it by
`python -m qarl.config --markdown`. Cross-field rules live in `checks.py`.
"""

from qarl.config.arms import ArmPlan, load_arms
from qarl.config.errors import ConfigError, Problem
from qarl.config.load import (
    DEFAULT_RECIPE,
    RECIPES_DIR,
    load_config,
    packaged_recipes,
    parse_overrides,
    recipe_path,
)
from qarl.config.schema import (
    SECTIONS,
    AlgoSection,
    CompareSection,
    DistSection,
    EvalSection,
    LogSection,
    LoraSection,
    ModelSection,
    MonitorSection,
    OverlongSection,
    QuantSection,
    RolloutSection,
    RunConfig,
    RunSection,
    SftSection,
    TaskSection,
    TrainSection,
)
from qarl.config.toml_out import RESOLVED_NAME, save_resolved, to_toml

__all__ = [
    "AlgoSection",
    "ArmPlan",
    "CompareSection",
    "ConfigError",
    "DEFAULT_RECIPE",
    "DistSection",
    "MonitorSection",
    "EvalSection",
    "LogSection",
    "LoraSection",
    "ModelSection",
    "OverlongSection",
    "Problem",
    "QuantSection",
    "RECIPES_DIR",
    "RESOLVED_NAME",
    "RolloutSection",
    "RunConfig",
    "RunSection",
    "SECTIONS",
    "SftSection",
    "TaskSection",
    "TrainSection",
    "load_arms",
    "load_config",
    "packaged_recipes",
    "parse_overrides",
    "recipe_path",
    "save_resolved",
    "to_toml",
]
