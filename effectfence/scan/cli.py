"""Command line for ``effectfence scan``: exit 0 whenever the scan ran, 2 on bad arguments."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import scan_path
from .report import render_json, render_table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="effectfence scan",
        description=(
            "List MCP tools (Python, TypeScript/JavaScript, Go, Rust) that could execute a "
            "side effect twice under retries or concurrent calls, with the evidence seen "
            "and what the scan cannot see."
        ),
    )
    parser.add_argument("path", help="file or directory holding the MCP server's source")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--min-score",
        type=int,
        default=1,
        metavar="N",
        help="list only tools scoring N or more (default: 1)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse already printed the message on stderr
        return 0 if exc.code == 0 else 2
    path = Path(args.path)
    if not path.exists():
        print(f"effectfence scan: error: path does not exist: {path}", file=sys.stderr)
        return 2
    report = scan_path(path, min_score=args.min_score)
    out = render_json(report) if args.json else render_table(report)
    # a name in the code may hold a lone surrogate: shown escaped, never a traceback
    sys.stdout.write(out.encode("utf-8", "backslashreplace").decode("utf-8"))
    return 0
