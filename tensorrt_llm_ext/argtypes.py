"""argparse ``type`` functions shared by the CLI and the benchmarks: a bad value is a usage line naming the flag,
exit 2, before any work. A base module (no torch): the CLI parses every command with it before anything heavy
is imported."""

from __future__ import annotations

import argparse
import os
from typing import Callable

MAX_TIMEOUT_S = 1e9  # timers and joins overflow past ~9.2e9 s; a billion seconds is "no bound" enough


def positive_int(text: str) -> int:
    """A size or a count: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def seconds(text: str) -> float:
    """A timeout: a finite number of seconds in (0, :data:`MAX_TIMEOUT_S`] (``nan`` would mean no bound, a negative
    one a job failed at once)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a number), got {text!r}") from None
    if not 0 < value <= MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"expected seconds in (0, {MAX_TIMEOUT_S:g}], got {text}")
    return value


def int_list(low: int = 1, high: int | None = None) -> Callable[[str], str]:
    """A comma-separated list of integers in ``[low, high]`` (``--batch-sizes 1,8,32``): an empty list, an item that
    is not an integer or one out of range is refused by name. Returns the text unchanged (each benchmark splits it
    where it uses it)."""

    def parse(text: str) -> str:
        items = [x.strip() for x in text.split(",")]
        try:
            values = [int(x) for x in items]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        bad = [v for v in values if v < low or (high is not None and v > high)]
        if bad:
            bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"expected integers {bound}, got {bad[0]} in {text!r}")
        return text

    return parse


def name_list(choices: tuple[str, ...]) -> Callable[[str], str]:
    """A comma-separated, non-empty subset of ``choices`` (``--tables main,tp``); returns the text."""

    def parse(text: str) -> str:
        names = [x.strip() for x in text.split(",")]
        unknown = [n for n in names if n not in choices]
        if unknown or not text.strip():
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(choices)}, got {text!r}")
        return text

    return parse


def output_file_error(path: str, flag: str) -> str | None:
    """One line if ``path`` cannot be written (checked before the work, not after it). A file the check creates is
    removed again: a run that then fails leaves no empty file behind."""
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return f"{flag} {path}: cannot write ({e.strerror or e})"
    if not existed:
        os.unlink(path)
    return None


def output_dir_error(path: str, flag: str) -> str | None:
    """One line if ``path`` is not a directory that exists or can be made (it is made here)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # a file in the way (FileExistsError / NotADirectoryError), no permission
        return f"{flag} {path}: not a directory this process can write ({e.strerror or e})"
    return None if os.access(path, os.W_OK | os.X_OK) else f"{flag} {path}: not writable"
