"""`UserError`: something the user gave qarl is wrong (a recipe, a file, a folder, a value),
as opposed to a bug in qarl.

Every `qarl` command prints a UserError as one clean screen, with no traceback, and exits
with status 2; any other exception is qarl's own bug and keeps its traceback. A message names
what was wrong (the file, key or value seen) and what to do instead.
`qarl.config.ConfigError`, every problem of a recipe at once, is one.
"""

from __future__ import annotations


class UserError(ValueError):
    """A user's input that qarl cannot use; the message says which and what to do."""
