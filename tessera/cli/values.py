"""Flag value types shared by the subcommands' parsers."""

from __future__ import annotations

import argparse


def int_or_auto(text: str) -> int | str:
    """An integer flag value, or the word ``auto``."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or auto, got {text!r}") from None
