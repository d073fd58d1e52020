"""The settings every recipe section shares."""

from pydantic import ConfigDict

# Strict: a recipe is typed TOML ("32" is not an int; an int is accepted as a float).
SECTION = ConfigDict(extra="forbid", strict=True, frozen=True)
