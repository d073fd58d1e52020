"""The `qarl` command line: every subcommand resolves to a module with a working --help."""

from __future__ import annotations

import pytest

from qarl.cli import COMMANDS, main


def test_command_modules_live_in_the_cli_package():
    """Each subcommand is one module of qarl.cli named after it; library packages hold no
    argument parsing."""
    assert {name: module for name, (module, _) in COMMANDS.items()} == {
        name: f"qarl.cli.{name}" for name in COMMANDS}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_has_help(command, capsys):
    """`qarl COMMAND --help` imports the command's module and prints its usage (exit 0)."""
    assert main([command, "--help"]) == 0
    assert f"qarl {command}" in capsys.readouterr().out


def test_unknown_arguments_are_refused_where_no_overrides_are_taken(capsys):
    """Only recipe-driven commands accept --section.key=value; `qarl models` refuses them
    (exit status 2, returned by main like any other status, not raised)."""
    assert main(["models", "--train.steps=3"]) == 2
    assert "unrecognized arguments: --train.steps=3" in capsys.readouterr().err


def test_bad_recipe_fails_before_any_work(capsys):
    """`qarl train` with bad overrides exits 2 listing every problem, before loading a model."""
    code = main(["train", "--rollout.batch_size=30", "--algo.los=tbpo"])
    err = capsys.readouterr().err
    assert code == 2
    assert "algo.los: unknown key 'los'; did you mean 'loss'?" in err
    assert "rollout.batch_size: 30 is not a multiple of rollout.group_size (8)" in err


def test_an_override_value_with_spaces_is_an_override():
    """A TOML table value holds spaces (`--quant.options={group_size = 64}`): it is a recipe
    override, not a positional argument (argparse alone reads it as one); `--key value` pairs
    and the command's own flags are told apart."""
    from qarl.cli import split_overrides

    overrides, others = split_overrides(
        ["tiny", "--quant.options={group_size = 64}", "--train.steps", "3", "--resume", "x"])
    assert overrides == ["--quant.options={group_size = 64}", "--train.steps", "3"]
    assert others == ["tiny", "--resume", "x"]
