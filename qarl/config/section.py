"""The settings every recipe section shares."""

from pydantic import ConfigDict

# Strict: a recipe is typed TOML ("32" is not an int; an int is accepted as a float).
SECTION = ConfigDict(extra="forbid", strict=True, frozen=True)

# Keys a run can leave alone, marked in docs/config.md by what they are for (a field's
# json_schema_extra): SPEED trades time or memory, and a run's results change at most by
# rounding; CHECK verifies or reports, and changes no result.
SPEED = {"kind": "speed"}
CHECK = {"kind": "check"}
KINDS = {"speed": "*Speed:* changes time or memory, results at most by rounding.",
         "check": "*Check:* verifies or reports, changes no result."}
