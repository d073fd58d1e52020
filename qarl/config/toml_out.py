"""Writing a RunConfig as TOML (no extra dependency) and saving the resolved one in a run folder.

The output is exactly what `load_config` reads back to an equal RunConfig: None fields are
omitted (their default is None), floats are written with repr (which round-trips), strings as
TOML basic strings.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from qarl.config.schema import RunConfig

RESOLVED_NAME = "config.toml"
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _key(key: str) -> str:
    return key if _BARE_KEY.match(key) else _string(key)


def _string(text: str) -> str:
    # JSON string escapes are valid TOML basic-string escapes; TOML also forbids a raw DEL.
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


def _float(number: float) -> str:
    if math.isnan(number):
        return "nan"
    if math.isinf(number):
        return "inf" if number > 0 else "-inf"
    text = repr(number)
    return text if "." in text or "e" in text else text + ".0"


def toml_value(value: Any) -> str:
    """One TOML literal: bool, int, float, str, list (inline array), dict (inline table)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        items = (f"{_key(str(k))} = {toml_value(v)}" for k, v in value.items() if v is not None)
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML; use a bool, int, "
                    "float, str, list or table")


def to_toml(config: RunConfig, header: str = "") -> str:
    """The config as a TOML document: one [section] per section, every non-None field."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for section, values in config.model_dump().items():
        if values is None:  # an optional section the recipe leaves out
            continue
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        lines += [f"{_key(key)} = {toml_value(value)}"
                  for key, value in values.items() if value is not None]
    return "\n".join(lines) + "\n"


def save_resolved(config: RunConfig, folder: str | Path) -> Path:
    """Write `folder/config.toml`, the fully resolved config of a run; returns its path.

    `qarl train folder/config.toml` (or `load_config` of it) gives back an equal config.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RESOLVED_NAME
    header = (f"Resolved config of run {config.run.name!r}: every option, defaults included.\n"
              f"Re-run it with: qarl train {path}")
    path.write_text(to_toml(config, header), encoding="utf-8")
    return path
