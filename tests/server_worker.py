"""A separate process driving a fence on a PostgreSQL or Redis store, for test_server_stores.

``python server_worker.py MODE JSON-ARGS``; it prints ``ready`` when set up, waits for a line
on stdin (the parent's "go", so all workers start together), and prints one JSON line with
what it saw. Executions are appended to a sink file opened O_APPEND, one line each: the
world outside the store, counted by the parent.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

from effectfence import EffectFence, EffectRequest, FenceConfig, IntentInFlight, Replay
from effectfence.errors import StoreUnavailable
from effectfence.store import open_store


def fire(sink: str, line: str) -> None:
    fd = os.open(sink, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def req(intent: str, agent: str) -> EffectRequest:
    return EffectRequest(intent, "order:777", "charge", {"cents": 77700}, agent)


def storm(a: dict[str, Any]) -> dict[str, Any]:
    """``threads`` threads, ``attempts`` prepares each, all on one intent, released together."""
    fence = EffectFence(FenceConfig(lease_ttl=30.0), store=open_store(a["url"]))
    tally = {"fresh": 0, "replay": 0, "in_flight": 0, "unavailable": 0, "errors": 0}
    lock = threading.Lock()
    barrier = threading.Barrier(a["threads"] + 1)
    hashes: set[str] = set()
    errors: list[str] = []

    def run(t: int) -> None:
        barrier.wait()
        for _ in range(a["attempts"]):
            try:
                adm = fence.prepare(req(a["intent"], f"p{os.getpid()}-t{t}"))
            except IntentInFlight:
                kind = "in_flight"
            except StoreUnavailable:
                kind = "unavailable"
            except Exception as exc:
                kind = "errors"
                errors.append(repr(exc))
            else:
                if adm.fresh:
                    fire(a["sink"], f"{os.getpid()} {t}")
                    hashes.add(fence.commit(adm.ticket, {"charged": 77700}).hash)
                    kind = "fresh"
                else:
                    assert isinstance(adm, Replay)
                    assert adm.cert.verify()
                    hashes.add(adm.cert.hash)
                    kind = "replay"
            with lock:
                tally[kind] += 1

    threads = [threading.Thread(target=run, args=(t,)) for t in range(a["threads"])]
    for th in threads:
        th.start()
    print("ready", flush=True)
    sys.stdin.readline()  # the parent's "go"
    barrier.wait()
    for th in threads:
        th.join()
    fence.close()
    return {**tally, "hashes": sorted(hashes), "error_samples": errors[:3]}


def commit_one(a: dict[str, Any]) -> dict[str, Any]:
    """Prepare once in a fresh process: commit if fresh, else report the replay."""
    fence = EffectFence(store=open_store(a["url"]))
    adm = fence.prepare(req(a["intent"], a.get("agent", "first")))
    if adm.fresh:
        out = {"fresh": True, "hash": fence.commit(adm.ticket, {"charged": 77700}).hash}
    else:
        out = {"fresh": False, "hash": adm.cert.hash, "verify": adm.cert.verify()}
    fence.close()
    return out


def silenced(a: dict[str, Any]) -> dict[str, Any]:
    """One prepare to warm the pool, ``ready``; after the parent's "go" (it has silenced
    the network meanwhile), one more prepare, timed: how it ended and when."""
    import time

    fence = EffectFence(FenceConfig(lease_ttl=60.0), store=open_store(a["url"]))
    fence.prepare(req("warm", "w"))
    print("ready", flush=True)
    sys.stdin.readline()
    started = time.monotonic()
    try:
        fence.prepare(req("silenced", "s"))
        outcome = "answered"
    except StoreUnavailable:
        outcome = "store_unavailable"
    return {"outcome": outcome, "seconds": time.monotonic() - started}


MODES = {"storm": storm, "commit_one": commit_one, "silenced": silenced}

if __name__ == "__main__":
    result = MODES[sys.argv[1]](json.loads(sys.argv[2]))
    print(json.dumps(result), flush=True)
