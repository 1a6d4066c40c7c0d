"""effectfence against its peers on the same work, each peer in its own virtual environment.

With ``--peers`` the suite installs each peer with pip from PyPI into its own venv under
``~/.cache/effectfence/peers/<name>`` (or ``$EFFECTFENCE_PEERS``), pinned, and runs
``benchmarks/contenders.py`` there through ``benchmarks/worker.py``: the peer's interpreter
sees the standard library, the peer and its dependencies, never effectfence. effectfence runs
the very same code in its own interpreter (the compiled core). Rounds are interleaved across
contenders, their order rotating, so drift hits all alike. A peer that fails to install is
reported as missing with pip's reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.sections.stores import server_store
from benchmarks.stats import ratio, summary
from benchmarks.suite import Context, Skip, Worker, postgres_facts, reachable, redis_facts

TITLE = "effectfence vs peers: the same work, the same stores"
#: replays by a client that did not write the intents, each read once (file stores)
REPLAY_OTHER = "replay, other client"

#: peer -> pinned pip requirement
PEERS: dict[str, str] = {
    "once-kernel": "once-kernel[postgres]==0.2.1",
    "idempotency": "idempotency==0.1.0",
    "aws-lambda-powertools": "aws-lambda-powertools[redis,aws-sdk]==3.37.0",
}

#: what effectfence does on every call, for the page
EFFECTFENCE_DOES = (
    "checks the payload (RFC 8785 canonical JSON of tool, args and domain) on every attempt; "
    "mints a SHA-256 certificate chained per domain at every commit; reserves a domain seq; "
    "lease with a monotonic fencing token; leases and TTLs judged by the store's clock"
)

#: where a peer does less than effectfence (or differently), said beside its rows
DOES_LESS: dict[str, str] = {
    "once-kernel": (
        "payload checked (RFC 8785 SHA-256) on every begin; lease + random fence token and a "
        "generation; NO certificate, NO domain seq; leases and TTLs judged by the client's "
        "wall clock (time.time), not the store's; its SQLite store hard-wires "
        "synchronous=NORMAL (so effectfence is measured at NORMAL beside it)"
    ),
    "idempotency": (
        "keyed by the intent: NO payload check (same key, other payload silently gets the "
        "first result); NO lease or fencing token (an in-flight duplicate blocks on a lock "
        "for up to 10 s); NO certificate; in memory only"
    ),
    "aws-lambda-powertools": (
        "idempotent_function keyed by the intent; in memory payload validation ON "
        "(payload_validation_jmespath='args': MD5 of sorted-key json.dumps, not canonical "
        "JSON), on Redis OFF, so NO payload check there: with it on, 3.37.0's Redis layer "
        "refuses every replay of a completed record (its _update_record drops the validation "
        "hash; seen while building this suite); NO certificate, NO fencing token; an "
        "in-progress record expires only with a Lambda context (none here); 'memory' is a "
        "dict+lock layer written here on its public BasePersistenceLayer"
    ),
}


def cache_dir() -> Path:
    env = os.environ.get("EFFECTFENCE_PEERS")
    return Path(env) if env else Path.home() / ".cache" / "effectfence" / "peers"


def ensure_venv(name: str, spec: str, ctx: Context) -> tuple[str | None, str]:
    """(python, "") when the peer is installed in its venv, else (None, why not)."""
    venv = cache_dir() / name
    python = venv / "bin" / "python"
    marker = venv / ".effectfence-spec"
    if python.exists() and marker.exists() and marker.read_text().strip() == spec:
        return str(python), ""
    ctx.progress(f"installing {spec} into {venv}")
    try:
        if not python.exists():
            subprocess.run(
                [sys.executable, "-m", "venv", str(venv)],
                check=True,
                capture_output=True,
                text=True,
                timeout=300,
            )
        pip = subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", spec],
            capture_output=True,
            text=True,
            timeout=900,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"venv could not be made: {exc}"
    if pip.returncode != 0:
        tail = " ".join(pip.stderr.strip().splitlines()[-2:])[-300:]
        return None, f"pip install {spec} failed: {tail}"
    marker.write_text(spec + "\n")
    return str(python), ""


def run(ctx: Context) -> dict[str, Any]:
    if not ctx.peers:
        raise Skip("not asked: run with --peers to install and measure the peers")
    rounds = ctx.pick(1, 5)
    storms = ctx.pick(1, 3)
    n_mem = ctx.pick((500, 2000), (5000, 20000))
    n_durable = ctx.pick((30, 200), (300, 3000))
    tmp = ctx.tmp / "peers"
    tmp.mkdir(exist_ok=True)

    peers: dict[str, dict[str, Any]] = {}
    workers: dict[str, Worker] = {}
    try:
        workers["effectfence"] = Worker(sys.executable, name="effectfence")
        for name, spec in PEERS.items():
            python, why = ensure_venv(name, spec, ctx)
            peers[name] = {
                "spec": spec,
                "venv": str(cache_dir() / name),
                "does_less": DOES_LESS[name],
            }
            if python is None:
                peers[name]["missing"] = why
                ctx.progress(f"{name}: MISSING ({why})")
                continue
            workers[name] = Worker(python, name=name, peer=True)
            peers[name]["python"] = workers[name].hello["python"]

        # store -> {contender: url or a reason it cannot run}
        sqlite_ef = f"sqlite:///{(tmp / 'ef.db').as_posix().lstrip('/')}?synchronous=normal"
        sqlite_once = f"sqlite:///{(tmp / 'once.db').as_posix().lstrip('/')}"
        plan: dict[str, dict[str, str]] = {
            "memory": {
                "effectfence": "memory:",
                "once-kernel": "memory:",
                "idempotency": "memory:",
                "aws-lambda-powertools": "memory:",
            },
            "sqlite NORMAL": {"effectfence": sqlite_ef, "once-kernel": sqlite_once},
            "postgresql": {"effectfence": ctx.pg_url, "once-kernel": ctx.pg_url},
            "redis": {"effectfence": ctx.redis_url, "aws-lambda-powertools": ctx.redis_url},
        }
        skipped: dict[str, dict[str, str]] = {}
        servers: dict[str, Any] = {}
        for store, port, facts in (
            ("postgresql", 5432, postgres_facts),
            ("redis", 6379, redis_facts),
        ):
            url = plan[store]["effectfence"]
            down = reachable(url, port)
            if down:
                skipped[store] = {c: down for c in plan[store]}
                del plan[store]
                continue
            servers[store] = facts(url)
            why = server_store(store, url, port)
            if why:
                skipped.setdefault(store, {})["effectfence"] = why
                del plan[store]["effectfence"]
        for store in list(plan):
            for c in list(plan[store]):
                if c not in workers:
                    skipped.setdefault(store, {})[c] = f"not installed: {peers[c]['missing']}"
                    del plan[store][c]
            if not plan[store]:
                del plan[store]

        samples: dict[tuple[str, str, str], list[float]] = {}
        versions: dict[str, str] = {}
        for rnd in range(rounds):
            for store, who in plan.items():
                n_fresh, n_replay = n_mem if store == "memory" else n_durable
                order = list(who)
                order = order[rnd % len(order) :] + order[: rnd % len(order)]
                work = [("fresh", "fresh", n_fresh), ("replay", "replay", n_replay)]
                if store.startswith("sqlite"):
                    # a duplicate from another process: the SQLite store's cache of its own
                    # writes answered every replay above, which no peer has (found by review)
                    work.append(("replay_other", REPLAY_OTHER, n_replay))
                for fn, scenario, n in work:
                    for c in order:
                        got = workers[c].call(
                            f"contenders:{fn}", contender=c, url=who[c], n=n, rnd=rnd
                        )
                        versions[c] = got["version"]
                        samples.setdefault((store, scenario, c), []).append(got["ops_s"])
                ctx.progress(f"round {rnd + 1}/{rounds}: {store} fresh and replay")
        storm_runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for i in range(storms):
            for store, who in plan.items():
                for c in who:
                    got = workers[c].call("contenders:storm", contender=c, url=who[c], rnd=1000 + i)
                    storm_runs.setdefault((store, c), []).append(got)
            ctx.progress(f"storm {i + 1}/{storms} on every store")
    finally:
        for w in workers.values():
            w.close()

    rows: list[dict[str, Any]] = []
    for (store, scenario, c), xs in samples.items():
        rows.append({"store": store, "scenario": scenario, "contender": c, "ops_s": summary(xs)})
    for row in rows:
        base = samples.get((row["store"], row["scenario"], "effectfence"))
        row["effectfence_over"] = ratio(summary(base), row["ops_s"]) if base else None
    storm_rows: list[dict[str, Any]] = []
    for (store, c), runs in storm_runs.items():
        storm_rows.append(
            {
                "store": store,
                "contender": c,
                "attempts": runs[0]["attempts"],
                "executions": [r["executions"] for r in runs],
                "refused": summary([r["refused"] for r in runs]),
                "guard_ms": summary([r["guard_ms"] for r in runs]),
            }
        )
    for row in storm_rows:
        base = [
            r for r in storm_rows if r["store"] == row["store"] and r["contender"] == "effectfence"
        ]
        row["over_effectfence"] = ratio(row["guard_ms"], base[0]["guard_ms"]) if base else None
    for name, v in versions.items():
        if name in peers:
            peers[name]["version"] = v
    n_runs = sum(len(v) for v in samples.values())
    ctx.check(
        f"{n_runs} timed rounds: one execution per fresh key and none on replays (sink), "
        "every replay returned the recorded result (effectfence: the committed "
        "certificate)"
    )
    ctx.check(
        f"{sum(len(v) for v in storm_runs.values())} storms of 1,000 attempts: exactly "
        "one execution each, counted at the sink"
    )
    return {
        "rounds": rounds,
        "storms": storms,
        "ops_memory": n_mem,
        "ops_durable": n_durable,
        "effectfence_does": EFFECTFENCE_DOES,
        "effectfence_version": versions.get("effectfence"),
        "peers": peers,
        "rows": rows,
        "storm_rows": storm_rows,
        "skipped": skipped,
        "servers": servers,
        "stores": list(plan),
    }
