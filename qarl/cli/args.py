"""Argument types the commands share: each turns a command-line value into what the command
uses, or refuses it (argparse prints the message with the command's usage, exit status 2) so
that a count of 0 or a list that names nothing is caught before any model loads."""

from __future__ import annotations

import argparse
import math
import re


def _whole(text: str) -> int | None:
    """The whole number `text` spells in ASCII digits (a leading '+' allowed), else None."""
    match = re.fullmatch(r"\s*\+?([0-9]+)\s*", text)
    return int(match.group(1)) if match else None


def positive_int(text: str) -> int:
    """A whole number of at least 1 (a count: prompts, tokens, jobs)."""
    value = _whole(text)
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def nonnegative_int(text: str) -> int:
    """A whole number of at least 0 (0: off, e.g. --lora-rank 0)."""
    value = _whole(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 0")
    return value


def positive_float(text: str) -> float:
    """A finite number above 0 (a sampling temperature)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number above 0")
    return value


def name_list(text: str) -> list[str]:
    """Comma-separated names, at least one: 'fp, qarl' -> ['fp', 'qarl']."""
    names = [item.strip() for item in text.split(",") if item.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names nothing; give comma-separated names, "
                                         "e.g. a,b")
    return names


def int_list(text: str) -> list[int]:
    """Comma-separated whole numbers of at least 0, at least one: '0,1,2' -> [0, 1, 2]."""
    values = [_whole(item) for item in text.split(",") if item.strip()]
    if not values or None in values:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole "
                                         "numbers of at least 0, e.g. 0,1,2")
    return values


def device(text: str) -> str:
    """A device qarl runs on that this machine has: 'cpu', 'cuda' or 'cuda:N' (train.device's
    rule, qarl.config.train_checks.device_exists)."""
    from qarl.config import DistSection, TrainSection
    from qarl.config.train_checks import device_exists

    # the check reads train.device and dist.learner_ranks alone: sections built unvalidated
    problems = device_exists(TrainSection.model_construct(device=text),
                             DistSection.model_construct(learner_ranks=1))
    if problems:
        raise argparse.ArgumentTypeError(problems[0].message)
    return text
