"""What the ``cutefa`` commands share: the user error, table output, and parsing a variant name or
a positive number from the command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from cutefa.model.spec import VariantSpec, parse_name


class UsageError(Exception):
    """A user error: reported on stderr without a traceback, exit status 2."""


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())


def spec_from_argument(name: str) -> VariantSpec:
    """The variant a NAME argument names, with or without the ``cutefa_`` prefix."""
    try:
        return parse_name(name if name.startswith("cutefa_") else f"cutefa_{name}")
    except ValueError as exc:
        raise UsageError(f"NAME: {exc}") from None


def positive_int(text: str) -> int:
    """An argparse type: a positive integer."""
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)
