"""Where qarl keeps what it prepares once per machine: `$QARL_HOME` (default `~/.cache/qarl`),
holding converted zoo models (`models/`) and compiled native kernels (`kernels/`). Imports
nothing of qarl, so every package may ask it."""

from __future__ import annotations

import os
from pathlib import Path


def qarl_home() -> Path:
    """`$QARL_HOME`, default `~/.cache/qarl`."""
    return Path(os.environ.get("QARL_HOME") or Path.home() / ".cache" / "qarl").expanduser()
