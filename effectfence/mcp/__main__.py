"""``python -m effectfence.mcp [serve] [options]``: the same as ``effectfence serve``."""

from __future__ import annotations

import sys

from effectfence.mcp.server import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["serve"]:
        argv = argv[1:]
    sys.exit(main(argv))
