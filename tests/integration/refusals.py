"""`refused`: a user error's contract, checked on one in-process `qarl` command."""

from __future__ import annotations

from qarl.cli import main


def refused(capsys, *argv: str) -> str:
    """Run `qarl ARGV` in process: it must exit with status 2 and print one message, no
    traceback. Returns what it printed on stderr."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.strip(), err
    return err
