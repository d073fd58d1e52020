"""Reading a run's metrics.jsonl: one JSON object per line, `step` and `kind` in every row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qarl.errors import UserError


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every row of a metrics.jsonl file, in file order (blank lines skipped); a figure the
    file holds as null (missing or not finite at that step) is left out of its row. A line
    that is not a JSON object with `step` and `kind` is a UserError naming the file and line."""
    rows = []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            row, why = None, str(err)
        else:
            why = f"{type(row).__name__}, not an object" if not isinstance(row, dict) else (
                "no 'step' and 'kind'" if not {"step", "kind"} <= set(row) else "")
        if why:
            raise UserError(f"{path} line {number} is not a row of metrics ({why}): the file "
                            "is damaged; restore it from the run's newest checkpoint "
                            "(step_NNNNNN/metrics.jsonl), or run the run again")
        rows.append({k: v for k, v in row.items() if v is not None})
    return rows
