"""`python -m qarl.cli ...` is `qarl ...`."""

from qarl.cli import entry

entry()
