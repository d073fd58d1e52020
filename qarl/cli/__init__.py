"""`qarl` command line: one subcommand per module of this package, each exposing
add_arguments(parser) and run(args); a module that sets ACCEPTS_OVERRIDES = True also takes
recipe overrides (--section.key=value), checked by qarl.config.

Modules are imported only for the subcommand that runs, so `qarl --help` stays fast.
A user error (`qarl.errors.UserError`: a bad recipe, file, folder or value) ends any command
with its message on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import re
import signal
import sys
import threading

from qarl.train import signals

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

# subcommand -> (module, one-line help). The module owns its arguments and behaviour.
COMMANDS = {
    "train": ("qarl.cli.train", "run RL training from a TOML recipe (default: recipes/default.toml)"),
    "sft": ("qarl.cli.sft", "warm-start a model by supervised fine-tuning on a built-in task"),
    "eval": ("qarl.cli.eval", "evaluate a model or checkpoint on a task's held-out set"),
    "parity": ("qarl.cli.parity", "measure learner-vs-engine logprob mismatch per scheme and alignment"),
    "models": ("qarl.cli.models", "list and prepare the embedded models"),
    "compare": ("qarl.cli.compare", "run the arms of a recipe's [compare] section (seeds x arms "
                "as qarl train runs) and write their report"),
    "export": ("qarl.cli.export", "write a run's or checkpoint's policy as a Hugging Face folder "
               "(full precision) or a compressed-tensors folder (quantized, for vLLM)"),
    "report": ("qarl.cli.report", "write the comparison report (report.md, compare.json, "
               "plots) of a qarl compare folder"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qarl",
        description="Reinforcement learning of LLMs with quantized rollouts and a "
        "rollout-aligned learner (QaRL + TBPO). `qarl COMMAND --help` for each command.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Arguments are added lazily in main() for the chosen command only.
    return parser


_OVERRIDE = re.compile(r"--[A-Za-z_]\w*\.[\w.]+(=.*)?", re.S)  # --section.key[=value]


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the recipe overrides, the other arguments): `--section.key=value`, or `--section.key`
    followed by its value."""
    overrides, others, i = [], [], 0
    while i < len(argv):
        match = _OVERRIDE.fullmatch(argv[i])
        if match is None:
            others.append(argv[i])
        else:
            overrides.append(argv[i])
            if match.group(1) is None and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                overrides.append(argv[i + 1])
                i += 1
        i += 1
    return overrides, others


class Interrupted(BaseException):
    """SIGINT / SIGTERM while a command starts or ends, outside the run's own handling
    (qarl.train.signals takes over while a run is under way). A BaseException, as
    KeyboardInterrupt is, so that no `except Exception` it passes through (a library probing
    an optional import while the command loads) takes it for an error and goes on."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame):
    # noted as well: where a bare `except:` swallows the exception all the same, a run that
    # starts afterwards stops at its first check (qarl.train.signals.stop_on_signals)
    signals.note(signum)
    raise Interrupted(signum)


def _load_extensions() -> None:
    """Import numpy and torch, the C extensions every command loads, with stop signals held
    until they are in: a signal that interrupts an extension's initialisation leaves it half
    loaded (its next import fails, or the process aborts), whatever catches the exception.
    A signal that arrived meanwhile stops the command right after (`Interrupted`)."""
    held: list[int] = []
    handlers = {s: signal.signal(s, lambda signum, frame: held.append(signum))
                for s in STOP_SIGNALS}
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
    if held:
        signals.note(held[0])
        raise Interrupted(held[0])


def main(argv: list[str] | None = None) -> int:
    """Run one `qarl` command; its exit status: 0, 2 for a user error (one message, no
    traceback), 128 + the signal's number for SIGINT / SIGTERM at any moment (130 / 143)."""
    import qarl

    qarl.ask_huge_pages()  # before any command imports torch (docs/performance.md)
    argv = sys.argv[1:] if argv is None else argv
    handled = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS} if handled else {}
    name = argv[0] if argv else "qarl"
    try:
        if handled and name in COMMANDS and not {"-h", "--help"} & set(argv):
            _load_extensions()
        return _run(argv)
    except (Interrupted, KeyboardInterrupt) as stop:
        signum = getattr(stop, "signum", signal.SIGINT)
        print(f"qarl {name}: stopped by {signal.Signals(signum).name} (a run keeps the steps "
              "it finished: qarl train --resume RUN_DIR continues it)", file=sys.stderr)
        return 128 + signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        signals.note(None)  # this command's; never the next in-process command's


def entry() -> None:
    """The `qarl` console script: `main`, then exit with its status. Once it returned, a
    stop signal no longer interrupts the interpreter's shutdown (whose status would be the
    signal's, not the command's)."""
    code = main()
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    sys.exit(code)


def _parse(argv: list[str]) -> tuple[argparse.Namespace, object]:
    """(the arguments, the command's module); argparse's SystemExit on --help or an argument
    it refuses (a bad choice, a count below 1: qarl.cli.args), which prints the usage."""
    parser = build_parser()
    if not argv or argv[0] not in COMMANDS:
        parser.parse_args(argv or ["--help"])
        parser.exit(2)
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    p = argparse.ArgumentParser(prog=f"qarl {name}", description=COMMANDS[name][1])
    module.add_arguments(p)
    # Recipe overrides (--section.key=value) are checked by the config layer, which names
    # the closest valid key; other unknown arguments are argparse errors. They are taken out
    # before argparse sees them: it reads an argument holding a space (a TOML table value such
    # as --quant.options={group_size = 64}) as a positional one.
    accepts = getattr(module, "ACCEPTS_OVERRIDES", False)
    overrides, others = split_overrides(argv[1:]) if accepts else ([], argv[1:])
    args, rest = p.parse_known_args(others)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    args.overrides = overrides
    return args, module


def _run(argv: list[str]) -> int:
    try:
        args, module = _parse(argv)
    except SystemExit as done:  # --help (0), or an argument error argparse printed (2)
        return done.code if isinstance(done.code, int) else 2
    name = argv[0]
    from qarl.errors import UserError

    try:
        return int(module.run(args) or 0)
    except UserError as err:
        print(f"qarl {name}: {err}", file=sys.stderr)
        return 2
