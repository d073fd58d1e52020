"""The [compare] section of a recipe: the arms `qarl compare` runs (qarl/config/arms.py).

Kept apart from schema.py, which imports it into `RunConfig.compare`; the same conventions
hold (strict, frozen, every field described once).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from qarl.config.section import SECTION as _SECTION


class CompareSection(BaseModel):
    """Arms of `qarl compare`: named override sets run side by side on this recipe, each seed
    of each arm an ordinary run folder `run.output_dir/run.name/ARM/seedK`. `qarl train`
    ignores this section."""

    model_config = _SECTION

    arms: dict[str, dict[str, Any]] = Field(
        ...,
        min_length=1,
        description="Arm name -> its overrides, dotted recipe keys as on the command line, "
        "e.g. `qarl-tbpo = {quant.align = \"kernel\", algo.loss = \"tbpo\"}`; a table value "
        "below a section key (e.g. `task.options`) replaces the recipe's, like "
        "--task.options={...} does. The run.* keys are set by compare and cannot be "
        "overridden. Command-line overrides of `qarl compare` apply after an arm's. Arms run "
        "and are reported in this order.",
    )
    seeds: list[int] = Field(
        default_factory=lambda: [0],
        min_length=1,
        description="run.seed of each run of every arm (same seeds, so same prompts and data "
        "order, for every arm); `qarl compare --seeds` overrides it.",
    )
    held_out_seeds: list[int] = Field(
        default_factory=list,
        description="Seeds kept out of the recipe's development: run with `seeds` by `qarl "
        "compare`, reported apart from them (report.md's held-out table, compare.json's "
        "`held_out`) and never averaged with them. None by default; "
        "`--compare.held_out_seeds=[]` runs the development seeds alone.",
    )
    optional: list[str] = Field(
        default_factory=list,
        description="Arms run only when named with `qarl compare --arms`.",
    )
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Overrides every arm shares, applied to the recipe before the arm's own, "
        "e.g. `{train.steps = 8}` for a quick comparison of a longer recipe. Same form as "
        "an arm's.",
    )
    reference: str | None = Field(
        None,
        description="The full-precision arm: the 100% of gap closed and the 1x of relative "
        "step speed in the report. Default: none (those columns are n/a).",
    )
    baseline: str | None = Field(
        None,
        description="The arm whose gap to the reference is to be closed (the 0% of gap closed: "
        "(arm - baseline) / (reference - baseline) of held-out accuracy). Default: none.",
    )

    def overrides_of(self, arm: str) -> dict[str, Any]:
        """What the arm changes in the recipe, shared overrides first, as {dotted key: value}
        like parsed command-line overrides."""
        return {**flatten_overrides(self.overrides), **flatten_overrides(self.arms[arm])}


def flatten_overrides(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{quant: {scheme: "none"}} -> {"quant.scheme": "none"}. TOML reads the dotted keys of
    `{quant.scheme = "none"}` as nested tables; they are flattened down to section.key only,
    so a table value of a key (task.options) replaces the recipe's, as on the command line."""
    flat: dict[str, Any] = {}
    for key, value in table.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and "." not in path:
            flat.update(flatten_overrides(value, path))
        else:
            flat[path] = value
    return flat
