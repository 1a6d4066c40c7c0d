"""A measuring process the suite talks to over JSON lines: one request, one answer.

    python benchmarks/worker.py        # reads {"call": "module:function", "kwargs": {...}}

Each request names a function of a module in ``benchmarks/`` (the directory is put on
``sys.path``) and its keyword arguments; the answer is ``{"ok": true, "value": ...}`` or
``{"ok": false, "error": "traceback"}``. The suite keeps one worker per contender alive and
asks them in turn, round by round, so drift on a shared machine hits all alike while each
contender runs in its own interpreter: a peer in its own virtual environment (standard library
and the peer only), effectfence's pure twin with ``EFFECTFENCE_COUNTERS=pure``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever a measured function prints must not break the protocol
    out.write(json.dumps({"ok": True, "value": {"python": sys.version.split()[0]}}) + "\n")
    out.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            module, _, func = req["call"].partition(":")
            value = getattr(importlib.import_module(module), func)(**req.get("kwargs", {}))
            answer = {"ok": True, "value": value}
        except BaseException:  # report everything; the suite decides
            answer = {"ok": False, "error": traceback.format_exc()}
        out.write(json.dumps(answer) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
