"""Subcommands of this part (see swarm.coordinator.cli)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    """Add this part's subcommands to the `swarm` parser."""
