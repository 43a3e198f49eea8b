"""Argument types the commands share (`oncegate` and `oncegate lab`): each turns a flag's text
into its value or refuses it with a sentence argparse prints."""

from __future__ import annotations

import argparse

from ..settings import database_url as urls


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def database_url(text: str) -> str:
    try:
        urls.parse(text)
    except urls.InvalidDatabaseUrl as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
