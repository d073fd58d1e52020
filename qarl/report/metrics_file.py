"""Reading a run's metrics.jsonl: one JSON object per line, `step` and `kind` in every row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every row of a metrics.jsonl file, in file order (blank lines skipped); a figure the
    file holds as null (missing or not finite at that step) is left out of its row."""
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append({k: v for k, v in json.loads(line).items() if v is not None})
    return rows
