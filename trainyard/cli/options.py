"""Options several commands share."""

from __future__ import annotations

import argparse


def add_overrides(parser: argparse.ArgumentParser, help: str) -> None:
    """-S KEY=VALUE (repeatable): a params.yaml value for this command."""
    parser.add_argument(
        "-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help
    )


def add_all_ranks(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--all-ranks",
        action="store_true",
        help="print every rank's lines (default: rank 0's, and any rank's warnings and errors; "
        "each rank's are in .trainyard/logs/RUN_ID/rank-N.log)",
    )
