"""load_config: recipe file (or packaged name) + overrides -> a validated, resolved RunConfig.

Every problem is collected (TOML syntax, unknown keys at any depth, wrong types and ranges,
cross-field rules, registry names) and raised once as a ConfigError.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from qarl.config.checks import run_checks
from qarl.config.errors import ConfigError, Problem, pydantic_problems, short, unknown_key
from qarl.config.schema import OPTIONAL_SECTIONS, SECTIONS, RunConfig
from qarl.model.tokenizer import is_template_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"  # shipped inside the wheel
DEFAULT_RECIPE = "default"
UNSET = object()  # an override value that removes the key, so its default applies


def packaged_recipes() -> list[str]:
    """Names of the recipes shipped with qarl (qarl/recipes/*.toml, without the suffix)."""
    return sorted(path.stem for path in RECIPES_DIR.glob("*.toml"))


def recipe_path(recipe: str | Path | None) -> Path:
    """The file of a recipe: an existing path, else a packaged name ('tiny' or 'tiny.toml')."""
    if recipe is None:
        recipe = DEFAULT_RECIPE
    path = Path(recipe)
    if path.is_file():
        return path
    name = path.name[:-5] if path.name.endswith(".toml") else path.name
    if path.parent == Path(".") and name in packaged_recipes():
        return RECIPES_DIR / f"{name}.toml"
    if path.is_dir():
        raise ConfigError([Problem("", f"{str(recipe)!r} is a folder, not a recipe file; give "
                                       "a TOML file (a run folder's recipe is its config.toml) "
                                       f"or a packaged recipe: {', '.join(packaged_recipes())}")])
    raise ConfigError([Problem("", f"recipe file {str(recipe)!r} not found; give a path to a "
                                   f"TOML file or a packaged recipe: "
                                   f"{', '.join(packaged_recipes())}")])


def parse_value(text: str) -> Any:
    """A command-line value as a TOML literal (1e-5, true, ["q_proj"], {a = 1}); otherwise the
    bare text as a string (w4a16-int4). An empty value means UNSET."""
    if text.strip() == "":
        return UNSET
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """['--train.lr=1e-5', '--rollout.top_k', '4', 'train.steps=3'] -> {'train.lr': 1e-05, ...}.

    Both `--key=value` and `--key value` are accepted; an empty value (`--task.name=`) unsets
    the key so its default applies.
    """
    overrides: dict[str, Any] = {}
    index = 0
    while index < len(items):
        item = items[index].removeprefix("--")
        if "=" in item:
            key, text = item.split("=", 1)
        elif index + 1 < len(items) and not items[index + 1].startswith("--"):
            key, text = item, items[index + 1]
            index += 1
        else:
            raise ConfigError([Problem(item, "override has no value; write "
                                             f"--{item}=VALUE (or --{item}= to unset it)")])
        if not key or any(not part for part in key.split(".")):
            raise ConfigError([Problem("", f"override {items[index]!r} has no valid "
                                           "section.key name; write --section.key=value")])
        overrides[key] = parse_value(text)
        index += 1
    return overrides


def apply_overrides(data: dict, overrides: Mapping[str, Any]) -> list[Problem]:
    """Set each dotted key in the nested recipe dict (in place); None or UNSET removes it."""
    problems = []
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node, path = data, []
        for part in parents:
            path.append(part)
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                problems.append(Problem(".".join(path), f"is {short(child)}, not a table, so "
                                                        f"override {key!r} cannot go inside it"))
                break
            node = child
        else:
            if value is None or value is UNSET:
                node.pop(leaf, None)
            else:
                node[leaf] = value
    return problems


def _validate_sections(data: dict) -> tuple[dict[str, BaseModel], list[Problem]]:
    """Each section validated on its own, so a bad one does not hide problems in another."""
    problems = [unknown_key("", key, SECTIONS, "section") for key in data if key not in SECTIONS]
    sections: dict[str, BaseModel] = {}
    for name, model in SECTIONS.items():
        if name in OPTIONAL_SECTIONS and name not in data:
            continue
        raw = data.get(name, {})
        if not isinstance(raw, dict):
            problems.append(Problem(name, f"should be a table [{name}], got {short(raw)}"))
            continue
        try:
            sections[name] = model.model_validate(raw)
        except ValidationError as error:
            problems += pydantic_problems(error.errors(), raw, model, name)
    return sections, problems


def _resolve(sections: dict[str, BaseModel], stem: str) -> None:
    """Fill the derived fields in place: run.name, dataset / model paths, eval defaults."""
    def update(section: str, **values: Any) -> None:
        values = {key: value for key, value in values.items() if value is not None}
        sections[section] = sections[section].model_copy(update=values)

    if "run" in sections and sections["run"].name is None:
        update("run", name=stem)
    if "model" in sections and Path(sections["model"].name).exists():
        update("model", name=str(Path(sections["model"].name).resolve()))
    if "task" in sections and sections["task"].dataset is not None:
        update("task", dataset=str(Path(sections["task"].dataset).resolve()))
    template = sections["task"].chat_template if "task" in sections else None
    if isinstance(template, str) and not is_template_text(template) and Path(template).is_file():
        update("task", chat_template=str(Path(template).resolve()))
    if all(name in sections for name in ("eval", "task", "rollout")):
        eval_, task, rollout = sections["eval"], sections["task"], sections["rollout"]
        update(
            "eval",
            size=eval_.size if eval_.size is not None else task.eval_size,
            temperature=eval_.temperature or rollout.temperature,
            max_new_tokens=eval_.max_new_tokens or rollout.max_new_tokens,
            top_p=eval_.top_p if eval_.top_p is not None else rollout.top_p,
            top_k=eval_.top_k if eval_.top_k is not None else rollout.top_k,
            min_p=eval_.min_p if eval_.min_p is not None else rollout.min_p,
        )


def _as_data(recipe: Any) -> tuple[dict, str, str]:
    """(nested dict, stem for run.name, label for messages) of a recipe in any accepted form."""
    if isinstance(recipe, RunConfig):
        return recipe.model_dump(exclude_none=True), recipe.run.name or "config", "config"
    if isinstance(recipe, Mapping):
        return _deep_copy(recipe), "config", "config"
    path = recipe_path(recipe)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # a BOM is not TOML's
    except tomllib.TOMLDecodeError as error:
        raise ConfigError([Problem("", f"not valid TOML: {error}")], str(path)) from None
    except UnicodeDecodeError as error:
        raise ConfigError([Problem("", f"not UTF-8 text (byte {error.object[error.start]:#04x} "
                                       f"at offset {error.start}); save the recipe as UTF-8")],
                          str(path)) from None
    except OSError as error:
        raise ConfigError([Problem("", f"cannot be read: {error.strerror}")], str(path)) from None
    return data, path.stem, str(path)


def _deep_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _deep_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_deep_copy(item) for item in value]
    return value


def load_config(
    recipe: str | Path | Mapping[str, Any] | RunConfig | None = None,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
) -> RunConfig:
    """Read, override, validate and resolve a recipe; raise one ConfigError listing all problems.

    recipe: a TOML path, a packaged recipe name ('default', 'tiny', 'compare'), a nested dict,
    or a RunConfig (re-checked); None = the packaged default.toml.
    overrides: {'train.steps': 5} (values used as-is, None unsets) or command-line strings
    ['--train.steps=5'] (values parsed as TOML literals, else bare strings).
    """
    data, stem, source = _as_data(recipe)
    if overrides is not None and not isinstance(overrides, Mapping):
        overrides = parse_overrides(list(overrides))
    problems = apply_overrides(data, overrides or {})
    sections, found = _validate_sections(data)
    problems += found
    _resolve(sections, stem)
    problems += run_checks(sections)
    if problems:
        raise ConfigError(problems, source)
    return RunConfig(**sections)
