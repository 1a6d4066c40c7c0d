"""A separate process driving a fence on a SQLite file, for test_sqlite's process tests.

``python sqlite_worker.py MODE JSON-ARGS``; it prints ``ready`` when it is set up, waits for
a line on stdin (the parent's "go", so all workers start together), and prints one JSON line
with what it saw. Executions are appended to a sink file opened O_APPEND, one line each:
the world outside the store, counted by the parent.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

from effectfence import EffectFence, EffectRequest, FenceConfig, IntentInFlight, Replay
from effectfence.store import default_store_url, open_store
from effectfence.store.sqlite import SQLiteStore
from effectfence.tickets import TicketSigner


def fire(sink: str, line: str) -> None:
    fd = os.open(sink, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def req(intent: str, agent: str) -> EffectRequest:
    return EffectRequest(intent, "order:777", "charge", {"cents": 77700}, agent)


def ready() -> None:
    print("ready", flush=True)
    sys.stdin.readline()  # the parent's "go"


def storm(a: dict[str, Any]) -> dict[str, Any]:
    """``threads`` threads, ``attempts`` prepares each, all on one intent."""
    fence = EffectFence(FenceConfig(lease_ttl=30.0), store=SQLiteStore(a["path"]))
    tally = {"fresh": 0, "replay": 0, "in_flight": 0, "errors": 0}
    lock = threading.Lock()
    barrier = threading.Barrier(a["threads"] + 1)
    hashes: set[str] = set()

    def run(t: int) -> None:
        barrier.wait()
        for _ in range(a["attempts"]):
            try:
                adm = fence.prepare(req(a["intent"], f"p{os.getpid()}-t{t}"))
            except IntentInFlight:
                kind = "in_flight"
            except Exception:
                kind = "errors"
            else:
                if adm.fresh:
                    fire(a["sink"], f"{os.getpid()} {t}")
                    hashes.add(fence.commit(adm.ticket, {"charged": 77700}).hash)
                    kind = "fresh"
                else:
                    assert isinstance(adm, Replay)
                    hashes.add(adm.cert.hash)
                    kind = "replay"
            with lock:
                tally[kind] += 1

    threads = [threading.Thread(target=run, args=(t,)) for t in range(a["threads"])]
    for th in threads:
        th.start()
    ready()
    barrier.wait()
    for th in threads:
        th.join()
    fence.close()
    return {**tally, "hashes": sorted(hashes)}


def hold(a: dict[str, Any]) -> dict[str, Any]:
    """Claim, then stop at ``phase`` and wait to be killed (SIGKILL) by the parent."""
    fence = EffectFence(FenceConfig(lease_ttl=a["lease"]), store=SQLiteStore(a["path"]))
    adm = fence.prepare(req(a["intent"], "doomed"))
    assert adm.fresh
    with open(a["ticket"] + ".tmp", "w") as f:
        json.dump(adm.ticket.to_dict(), f)
    os.replace(a["ticket"] + ".tmp", a["ticket"])
    if a["phase"] in ("during_effect", "after_effect"):
        fire(a["sink"], "doomed start")
    if a["phase"] == "after_effect":
        fire(a["sink"], "doomed done")
    print("ready", flush=True)
    threading.Event().wait()  # killed here
    raise AssertionError("unreachable")


def commit_one(a: dict[str, Any]) -> dict[str, Any]:
    fence = EffectFence(store=open_store(a["url"]))
    adm = fence.prepare(req(a["intent"], a.get("agent", "first")))
    if adm.fresh:
        cert = fence.commit(adm.ticket, {"charged": 77700})
        out = {"fresh": True, "hash": cert.hash}
    else:
        out = {"fresh": False, "hash": adm.cert.hash, "verify": adm.cert.verify()}
    fence.close()
    return out


def seal(a: dict[str, Any]) -> dict[str, Any]:
    """Open the default store, prepare, and hand the sealed ticket to the parent."""
    url = default_store_url()
    store = open_store(url)
    fence = EffectFence(store=store)
    adm = fence.prepare(req(a["intent"], "sealer"))
    signer = TicketSigner(store.sealing_key(), scope=store.ticket_scope)
    out = {"url": url, "wire": signer.seal(adm.ticket), "scope": store.ticket_scope}
    fence.close()
    return out


def open_and_commit(a: dict[str, Any]) -> dict[str, Any]:
    """Open the default store, open another process's sealed ticket, commit it."""
    url = default_store_url()
    store = open_store(url)
    fence = EffectFence(store=store)
    signer = TicketSigner(store.sealing_key(), scope=store.ticket_scope)
    cert = fence.commit(signer.open(a["wire"]), {"sealed": "elsewhere"})
    out = {"url": url, "hash": cert.hash, "scope": store.ticket_scope}
    fence.close()
    return out


MODES = {
    "storm": storm,
    "hold": hold,
    "commit_one": commit_one,
    "seal": seal,
    "open_and_commit": open_and_commit,
}

if __name__ == "__main__":
    result = MODES[sys.argv[1]](json.loads(sys.argv[2]))
    print(json.dumps(result), flush=True)
