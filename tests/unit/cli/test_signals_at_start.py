"""A stop signal while a command loads is never lost: qarl.cli's handler raises an exception
that `except Exception` cannot take (a library probing an optional import), and notes the
signal, so a run that starts after a bare `except:` swallowed it all the same stops at its
first check; the note ends with the command."""

from __future__ import annotations

import os
import signal
import time

import pytest

import qarl.cli as cli
from qarl.train import signals


def _deliver(signum: int) -> None:
    os.kill(os.getpid(), signum)
    time.sleep(0.05)  # the handler runs in the main thread at the next bytecode


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_inside_a_library_except_exception_still_stops_the_command(
        monkeypatch, capsys, signum, status):
    def command(argv):
        try:  # what an import-time probe of an optional dependency does
            _deliver(signum)
        except Exception:  # noqa: BLE001
            pass
        return 0

    monkeypatch.setattr(cli, "_run", command)
    assert cli.main(["train"]) == status
    assert signal.Signals(signum).name in capsys.readouterr().err
    assert signals._noted is None  # the command's note ends with it


def test_a_signal_a_bare_except_swallowed_stops_the_run_at_its_first_check(monkeypatch):
    seen = {}

    def command(argv):
        try:
            _deliver(signal.SIGINT)
        except BaseException:  # noqa: BLE001 - a bare except, as some libraries have
            pass
        with signals.stop_on_signals():  # the run starts
            with pytest.raises(signals.StopRequested) as stop:
                signals.check_stop()
            seen["signum"] = stop.value.signum
        with signals.stop_on_signals():  # one note, one stop
            signals.check_stop()
        return 0

    monkeypatch.setattr(cli, "_run", command)
    assert cli.main(["train"]) == 0
    assert seen["signum"] == signal.SIGINT and signals._noted is None


def test_a_signal_while_the_c_extensions_load_waits_for_them(monkeypatch):
    """numpy and torch load with stop signals held (an extension interrupted in its
    initialisation stays half loaded): a SIGINT during torch's import lets the import end,
    then stops the command (Interrupted, the signal noted), and the handlers are back."""
    import builtins

    real_import, finished = builtins.__import__, []

    def importing(name, *args, **kwargs):
        module = real_import(name, *args, **kwargs)
        if name == "torch":
            _deliver(signal.SIGINT)  # inside the import statement
            finished.append(name)
        return module

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(builtins, "__import__", importing)
    with pytest.raises(cli.Interrupted) as stop:
        cli._load_extensions()
    monkeypatch.undo()
    assert finished == ["torch"] and stop.value.signum == signal.SIGINT
    assert signals._noted == signal.SIGINT and signal.getsignal(signal.SIGINT) is before
    signals.note(None)
