"""The arms of a comparison: the recipe's [compare] section resolved into one checked
RunConfig per arm, before any run starts.

    plan = load_arms("compare", ["--train.steps=4"], arms=["fp-grpo", "qarl-tbpo"])
    plan.configs["qarl-tbpo"].algo.loss, plan.folder / "qarl-tbpo" / "seed0"

Every arm (chosen or not) is the recipe changed by compare.overrides, then by the arm's own
overrides, then by the command-line overrides (the command line has the last word, as for
`qarl train`); a problem in any arm is reported with the arm's name, all of them at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qarl.config.errors import ConfigError, Problem, suggest
from qarl.config.load import load_config, parse_overrides, recipe_path
from qarl.config.schema import RunConfig
from qarl.config.toml_out import RESOLVED_NAME


@dataclass(frozen=True)
class ArmPlan:
    """What `qarl compare` runs: each chosen arm's config and overrides, the seeds, and the
    comparison folder (`run.output_dir/run.name` of the recipe) that holds ARM/seedK."""

    recipe: Path  # the recipe file every run starts from
    overrides: dict[str, Any]  # command-line overrides, applied to every arm after its own
    arm_overrides: dict[str, dict[str, Any]]  # chosen arm -> compare.overrides + the arm's
    configs: dict[str, RunConfig]  # chosen arm -> resolved config (run.seed not yet set)
    seeds: list[int]  # every seed that runs: compare.seeds, then compare.held_out_seeds
    folder: Path

    def run_dir(self, arm: str, seed: int) -> Path:
        return self.folder / arm / f"seed{seed}"


def load_arms(recipe: str | Path | None, overrides: Sequence[str] | Mapping[str, Any] = (),
              arms: Sequence[str] | None = None) -> ArmPlan:
    """Check the recipe and every arm; raise one ConfigError listing every problem.

    overrides: as for load_config (e.g. {"compare.seeds": [0, 1]} for other seeds);
    arms: the arms to run, in this order (default: every arm not in compare.optional).
    """
    path = recipe_path(recipe)
    if not isinstance(overrides, Mapping):
        overrides = parse_overrides(list(overrides))
    base = load_config(path, overrides)  # a broken base breaks every arm: report it alone
    compare = base.compare
    if compare is None:
        raise ConfigError([Problem("compare", "the recipe has no [compare] section; add "
                                              "[compare.arms] with one table of overrides per "
                                              "arm (docs/config.md)")], str(path))
    problems = [Problem("--arms", f"{arm!r} is not an arm of the recipe; "
                                  f"{suggest(arm, compare.arms)}")
                for arm in arms or () if arm not in compare.arms]
    if arms is not None and not arms:
        problems.append(Problem("--arms", f"names no arm; name one or more of "
                                          f"{', '.join(compare.arms)}, or leave --arms out"))
    if arms and len(set(arms)) < len(arms):
        problems.append(Problem("--arms", f"{','.join(arms)} names an arm twice; name each once"))
    if "run.seed" in overrides:
        problems.append(Problem("run.seed", "is set by compare for each run from "
                                            "compare.seeds; give the seeds with --seeds"))
    folder = Path(base.run.output_dir) / str(base.run.name)
    if (folder / RESOLVED_NAME).is_file():
        problems.append(Problem("run.name", f"{folder} is the run folder of a `qarl train` run "
                                            f"(it holds {RESOLVED_NAME}), not a comparison "
                                            "folder; give the comparison its own --run.name "
                                            "or --run.output_dir"))
    configs: dict[str, RunConfig] = {}
    for arm in compare.arms:
        try:
            configs[arm] = load_config(path, {**compare.overrides_of(arm), **overrides})
        except ConfigError as error:
            problems += [Problem(f"compare.arms.{arm}", f"gives {problem}")
                         for problem in error.problems]
    if problems:
        raise ConfigError(problems, str(path))
    chosen = list(arms) if arms else [arm for arm in compare.arms if arm not in compare.optional]
    return ArmPlan(
        recipe=path, overrides=dict(overrides),
        arm_overrides={arm: compare.overrides_of(arm) for arm in chosen},
        configs={arm: configs[arm] for arm in chosen},
        seeds=list(compare.seeds) + list(compare.held_out_seeds),
        folder=folder,
    )
