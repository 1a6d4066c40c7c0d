"""Each store: fresh prepare+commit and replay per second, 1 client / 8 threads / 4 processes:
``bench_stores.measure`` (executions counted at an O_APPEND sink file, every replay checked
against the committed hash), with each durable store's physical limit (a hand-written claim
and complete, one statement or command per step) and, for SQLite and PostgreSQL, the
contract's floor (the least the contract's steps must write, hand-written on the store's
indexes: :class:`bench_stores.FloorSQLiteClient`) in the same run. PostgreSQL and Redis rows
run when effectfence has the store and the server answers.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

from benchmarks import bench_stores
from benchmarks.stats import summary
from benchmarks.suite import Context, postgres_facts, reachable, redis_facts

TITLE = "Stores"


def server_store(scheme: str, url: str, port: int) -> str | None:
    """None if effectfence's store for ``scheme`` can run against ``url``, else why not."""
    module = {"postgresql": "effectfence.store.postgres", "redis": "effectfence.store.redis"}[
        scheme
    ]
    if importlib.util.find_spec(module) is None:
        return f"{module} is not in this build yet (it lands with the PostgreSQL/Redis stores)"
    driver = {"postgresql": "psycopg", "redis": "redis"}[scheme]
    if importlib.util.find_spec(driver) is None:
        extra = "postgres" if scheme == "postgresql" else "redis"
        return f"its driver is not installed (pip install 'effect-fence[{extra}]')"
    return reachable(url, port)


def run(ctx: Context) -> dict[str, Any]:
    import sqlite3

    rounds = ctx.pick(1, 3)
    nf, nr = ctx.pick((100, 1000), (400, 4000))
    modes = ctx.pick(("1 client",), bench_stores.MODES)
    tmp = str(ctx.tmp / "stores")
    os.makedirs(tmp, exist_ok=True)

    def sqlite_url(sync: str, name: str) -> Callable[[int, str, str], str]:
        def url(r: int, s: str, m: str) -> str:
            path = os.path.join(tmp, f"{name}-{r}-{s}-{m[0]}.db").lstrip("/")
            return f"sqlite:///{path}" + ("?synchronous=normal" if sync == "normal" else "")

        return url

    # (row, client kind, url per round/scenario/mode, shared across processes, durability)
    rows: list[tuple[str, str, Callable[[int, str, str], str], bool, str]] = [
        ("memory", "fence", lambda r, s, m: "memory:", False, "none (one process)"),
        (
            "sqlite FULL",
            "fence",
            sqlite_url("full", "full"),
            True,
            "WAL, synchronous=FULL: fsync at every commit",
        ),
        (
            "raw sqlite FULL (limit)",
            "raw",
            sqlite_url("full", "rawfull"),
            True,
            "WAL, synchronous=FULL",
        ),
        (
            "floor sqlite FULL (contract)",
            "floor",
            sqlite_url("full", "floorfull"),
            True,
            "WAL, synchronous=FULL",
        ),
        (
            "sqlite NORMAL",
            "fence",
            sqlite_url("normal", "normal"),
            True,
            "WAL, synchronous=NORMAL: a power cut may lose the last commits, never corrupts",
        ),
        (
            "raw sqlite NORMAL (limit)",
            "raw",
            sqlite_url("normal", "rawnormal"),
            True,
            "WAL, synchronous=NORMAL",
        ),
        (
            "floor sqlite NORMAL (contract)",
            "floor",
            sqlite_url("normal", "floornormal"),
            True,
            "WAL, synchronous=NORMAL",
        ),
    ]
    if ctx.quick:  # their 1,000-key replay setup alone takes ~10 s at one fsync per commit
        rows = [r for r in rows if "FULL" not in r[0]]
    servers: dict[str, Any] = {"sqlite": {"version": sqlite3.sqlite_version}}
    skipped: dict[str, str] = {}
    for scheme, url, port, facts in (
        ("postgresql", ctx.pg_url, 5432, postgres_facts),
        ("redis", ctx.redis_url, 6379, redis_facts),
    ):
        why = server_store(scheme, url, port)
        if why is None:
            servers[scheme] = facts(url)
            settings = ", ".join(f"{k}={v}" for k, v in servers[scheme].items() if k != "version")
            raw = "rawpg" if scheme == "postgresql" else "rawredis"
            limit = f"raw {scheme} (limit)"
            rows += [
                (scheme, "fence", bench_stores.namespaced(scheme, url), True, settings),
                (limit, raw, bench_stores.namespaced(scheme, url), True, settings),
            ]
            if scheme == "postgresql":
                floor = f"floor {scheme} (contract)"
                make = bench_stores.namespaced(scheme, url)
                rows.append((floor, "floorpg", make, True, settings))
        else:
            skipped[scheme] = why
            ctx.progress(f"{scheme} row skipped: {why}")
            if reachable(url, port) is None:  # still say what the server is, for the peers
                servers[scheme] = facts(url)
    results: dict[tuple[str, str, str], list[float]] = {}
    try:
        for rnd in range(rounds):
            for scenario, n in (("fresh", nf), ("replay", nr)):
                for mode in modes:
                    for name, kind, url, shared, _ in rows:
                        if mode == "4 processes" and not shared:
                            continue
                        rate = bench_stores.measure(
                            kind, url(rnd, scenario, mode), scenario, mode, n, tmp, rnd
                        )
                        results.setdefault((name, scenario, mode), []).append(rate)
                    ctx.progress(f"round {rnd + 1}/{rounds} {scenario} {mode}")
    finally:
        dropped = bench_stores.drop_namespaces()
        if dropped:
            ctx.progress(f"dropped {dropped} benchmark namespaces on the servers")
    table = []
    for name, kind, _, _, durability in rows:
        entry: dict[str, Any] = {"store": name, "kind": kind, "durability": durability}
        for scenario in ("fresh", "replay"):
            for mode in modes:
                v = results.get((name, scenario, mode))
                entry[f"{scenario} {mode}"] = summary(v) if v else None
        table.append(entry)
    ctx.check(
        "every fresh op wrote exactly one line to the sink file and no replay wrote any; "
        "every replay returned the committed certificate"
    )
    return {
        "rounds": rounds,
        "fresh_ops": nf,
        "replay_ops": nr,
        "modes": list(modes),
        "rows": table,
        "skipped_rows": skipped,
        "servers": servers,
    }
