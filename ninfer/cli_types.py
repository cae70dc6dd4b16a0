"""The argparse `type=` functions of the `ninfer` flags: each turns one flag's text into its value or refuses it
with an `argparse.ArgumentTypeError` naming what it accepts, so that a bad flag is one line at parse time, before
any work. Numbers must be finite and in range; paths must be what the command will read or write.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from ninfer.errors import NinferError

PORT_MAX = 65535


class UsageError(NinferError):
    """A command line that the parser refuses; its message is the whole line, `ninfer CMD: error: ...`."""


class Parser(argparse.ArgumentParser):
    """argparse that raises `UsageError` with one line instead of printing the usage and exiting (the usage is in
    --help); its subcommand parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: error: {message}")


def _integer(text: str) -> int:
    try:
        return int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def positive_int(text: str) -> int:
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def non_negative_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def int_at_least(low: int) -> Callable[[str], int]:
    """An integer type that refuses values below `low`."""

    def at_least(text: str) -> int:
        value = _integer(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r} must be at least {low}")
        return value

    return at_least


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An integer type that refuses values outside `low`..`high`."""

    def between(text: str) -> int:
        value = _integer(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text!r} must be {low}..{high}")
        return value

    return between


def tcp_port(text: str) -> int:
    """A TCP port, 0 to 65535 (0: the system picks a free one)."""
    value = _integer(text)
    if not 0 <= value <= PORT_MAX:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to {PORT_MAX}; 0 picks a free one)")
    return value


def finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def positive_finite_float(text: str) -> float:
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be positive")
    return value


def probability(text: str) -> float:
    """A number in [0, 1]."""
    value = finite_float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a probability (0 to 1)")
    return value


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of {what}") from None


def positive_int_list(text: str) -> list[int]:
    """Comma-separated positive integers, at least one."""
    values = _int_list(text, "integers")
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return values


def token_ids(text: str) -> list[int]:
    """Comma-separated token ids (integers >= 0), at least one."""
    ids = _int_list(text, "token ids")
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: token ids are 0 or more")
    return ids


def existing_file(text: str) -> Path:
    """A file to read: it exists, is a file (not a folder) and is readable."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: is a directory, not a file")
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{path}: no such file")
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{path}: not a regular file")
    if not os.access(path, os.R_OK):
        raise argparse.ArgumentTypeError(f"{path}: not readable (permission denied)")
    return path


def existing_dir(text: str) -> Path:
    """A folder to read: it exists and is a folder."""
    path = Path(text)
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{path}: no such folder")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: not a folder")
    return path


def writable_file(text: str) -> Path:
    """A file to write or append to, in an existing writable folder; if it exists, a writable file. Whether an
    existing file may be replaced is the command's decision (see `--force`)."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: is a directory; give a file name")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"{path.parent}: no such folder")
    return _writable(path, path.parent)


def output_file(text: str) -> Path:
    """A file a command creates, with any missing folders on its way: the nearest existing folder above it must be
    writable, and nothing on the way may be a file."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{path}: is a directory; give a file name")
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{folder}: is a file, not a folder")
    return _writable(path, folder)


def _writable(path: Path, folder: Path) -> Path:
    """`path`, when `folder` (the existing folder it goes into) and the file itself, if it exists, are writable."""
    if not os.access(folder, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{folder}: folder not writable (permission denied)")
    if path.exists() and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"{path}: not writable (permission denied)")
    return path
