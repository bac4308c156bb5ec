"""The error type for a user's mistake: the CLI prints its message on one line, without a traceback."""

from __future__ import annotations


class UserError(Exception):
    """Bad input (a path, a flag, a file): the message says what is wrong and what to do."""
