"""`python -m qarl.config --markdown`: print docs/config.md; `python -m qarl.config RECIPE
[--section.key=value ...]`: check a recipe and print it fully resolved (or every problem)."""

from __future__ import annotations

import sys

from qarl.config.errors import ConfigError
from qarl.config.load import load_config
from qarl.config.markdown import generate_markdown
from qarl.config.toml_out import to_toml


def main(argv: list[str]) -> int:
    if argv[:1] == ["--markdown"]:
        sys.stdout.write(generate_markdown())
        return 0
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    recipe = argv[0] if argv and not argv[0].startswith("--") else None
    overrides = argv[1:] if recipe is not None else argv
    try:
        sys.stdout.write(to_toml(load_config(recipe, overrides)))
    except ConfigError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
