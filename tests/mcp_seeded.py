"""A server whose fence starts in every state, the same in every process: for clients that
spawn a fresh stdio server per call (the MCP Inspector CLI), and for one HTTP server alike.

``seeded()`` builds the fence with a constant clock, a fixed ticket key and scope and a fixed
sequence of operations, so the tickets it seals are byte-identical in the test process and
in every server process: a test computes them in-process and hands them to a client whose
server is another process. ``CASES`` then reaches every refusal code and every answer shape,
and each case touches only its own intent, so the cases give the same answers in any order
and whether they share one server or each get a fresh one.

    python tests/mcp_seeded.py                          # stdio
    python tests/mcp_seeded.py --http 0 --tokens FILE   # streamable HTTP, principals
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from effectfence import EffectFence, FenceConfig
from effectfence.errors import StoreUnavailable
from effectfence.model import Admission
from effectfence.tickets import TicketSigner

KEY = b"seeded-ticket-key-0123456789abcdef"
SCOPE = "seeded"
PRINCIPAL = "alice"
TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdef0"}
ARGS = {"cents": 500}


def _clock() -> float:
    return 1000.0  # leases never lapse, results never expire: the states hold still


class _Fence(EffectFence):
    """The store behind intent ``seed:down`` is unreachable."""

    def request(self, intent: str, *args: Any, **kwargs: Any) -> Admission:
        if intent == "seed:down":
            raise StoreUnavailable("the store did not answer", intent=intent)
        return super().request(intent, *args, **kwargs)


def seeded() -> tuple[EffectFence, TicketSigner, dict[str, Any]]:
    fence = _Fence(FenceConfig(clock=_clock, auto_sweep=False))
    signer = TicketSigner(KEY, scope=SCOPE)

    def hold(intent: str) -> Any:
        return fence.request(intent, "seed:d", "charge", ARGS, PRINCIPAL).ticket

    fence.request("seed:held", "seed:d", "charge", ARGS, PRINCIPAL)
    done = hold("seed:done")
    cert = fence.commit(done, {"charge": "ch_1"})
    fence.abort(hold("seed:failed"), "gateway timeout")
    fence.abort(hold("seed:to-clear"), "gateway timeout")
    lost = hold("seed:lost")
    fence.release(lost)
    seal = signer.seal
    data = {
        "cert": {**cert.to_dict(), "read_set": [list(p) for p in cert.read_set]},
        "to-commit": seal(hold("seed:to-commit")),
        "to-abort": seal(hold("seed:to-abort")),
        "to-release": seal(hold("seed:to-release")),
        "to-renew": seal(hold("seed:to-renew")),
        "lost": seal(lost),
        "seq": fence.current("seed:d"),
    }
    return fence, signer, data


def _prepare(intent: str, **over: Any) -> dict[str, Any]:
    return {
        "intent": intent,
        "domain": "seed:d",
        "tool": "charge",
        "args": ARGS,
        "agent": PRINCIPAL,
        **over,
    }


@dataclass(frozen=True)
class Case:
    name: str
    tool: str
    arguments: dict[str, Any]
    #: a refusal code, or for an answer the fields it must carry
    code: str | None = None
    expect: Mapping[str, Any] | None = None


def _status(s: str) -> dict[str, str]:
    return {"status": s}


def _state(s: str) -> dict[str, str]:
    return {"state": s}


def cases(data: dict[str, Any]) -> list[Case]:
    broken = {**data["cert"], "result": {"charge": "ch_forged"}}
    return [
        # every answer shape
        Case("fresh", "fence_prepare", _prepare("seed:new"), expect={"status": "fresh"}),
        Case("replay", "fence_prepare", _prepare("seed:done"), expect={"status": "replay"}),
        Case(
            "committed",
            "fence_commit",
            {"prepared": data["to-commit"], "result": {"charge": "ch_2"}},
            expect={"status": "committed"},
        ),
        Case(
            "aborted",
            "fence_abort",
            {"prepared": data["to-abort"], "reason": "timeout"},
            expect={"status": "aborted"},
        ),
        Case(
            "released",
            "fence_release",
            {"prepared": data["to-release"]},
            expect={"status": "released"},
        ),
        Case("renewed", "fence_renew", {"prepared": data["to-renew"]}, expect=_status("renewed")),
        Case("status-absent", "fence_status", {"intent": "seed:none"}, expect={"state": "absent"}),
        Case("status-held", "fence_status", {"intent": "seed:held"}, expect={"state": "in_flight"}),
        Case("status-done", "fence_status", {"intent": "seed:done"}, expect={"state": "done"}),
        Case("status-failed", "fence_status", {"intent": "seed:failed"}, expect=_state("failed")),
        Case("stats", "fence_stats", {}, expect={"store": "memory"}),
        Case("verify-ok", "fence_verify", {"cert": data["cert"]}, expect={"ok": True}),
        Case("verify-broken", "fence_verify", {"cert": broken}, expect={"ok": False}),
        Case(
            "verify-chain",
            "fence_verify",
            {"chain": [data["cert"]]},
            expect={"ok": True, "kind": "chain"},
        ),
        Case(
            "cleared",
            "fence_clear",
            {"intent": "seed:to-clear", "reason": "refunded by hand"},
            expect={
                "cleared": True,
                "previous_state": "failed",
                "reason": "refunded by hand",
                "forced": False,
            },
        ),
        Case(
            "clear-absent",
            "fence_clear",
            {"intent": "seed:none", "reason": "nothing there"},
            expect={"cleared": False, "previous_state": "absent"},
        ),
        # every refusal code
        Case("in-flight", "fence_prepare", _prepare("seed:held"), code="intent_in_flight"),
        Case("failed", "fence_prepare", _prepare("seed:failed"), code="intent_failed"),
        Case(
            "conflict",
            "fence_prepare",
            _prepare("seed:done", args={"cents": 999}),
            code="intent_conflict",
        ),
        Case(
            "stale",
            "fence_prepare",
            _prepare("seed:stale", read_set=[["seed:d", 0]]),
            code="read_set_stale",
        ),
        Case("race", "fence_prepare", _prepare("seed:race", expected_seq=0), code="domain_race"),
        Case(
            "lease-lost",
            "fence_commit",
            {"prepared": data["lost"], "result": 1},
            code="lease_lost",
        ),
        Case(
            "bad-ticket",
            "fence_commit",
            {"prepared": data["lost"][:-1] + "0", "result": 1},
            code="invalid_ticket",
        ),
        Case(
            "bad-request",
            "fence_prepare",
            _prepare("seed:typo", surprise=1),
            code="invalid_request",
        ),
        Case("store-down", "fence_prepare", _prepare("seed:down"), code="store_unavailable"),
        # the operator's clear: a reason always, force for a live lease
        Case(
            "clear-held",
            "fence_clear",
            {"intent": "seed:held", "reason": "looks stuck"},
            code="intent_in_flight",
        ),
        Case("clear-no-reason", "fence_clear", {"intent": "seed:failed"}, code="invalid_request"),
        Case(
            "clear-blank-reason",
            "fence_clear",
            {"intent": "seed:failed", "reason": " "},
            code="invalid_request",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    import anyio

    from effectfence.mcp.http import Principals, parse_bind, serve_http
    from effectfence.mcp.server import build_server
    from effectfence.mcp.telemetry import Metrics

    parser = argparse.ArgumentParser()
    parser.add_argument("--http")
    parser.add_argument("--tokens", action="store_true", help="use TOKENS")
    args = parser.parse_args(argv)
    fence, signer, _ = seeded()
    metrics = Metrics()
    principals = None
    if args.tokens:
        principals = Principals.parse("\n".join(f"{p} {t}" for p, t in TOKENS.items()))
    server = build_server(
        fence,
        allow_clear=True,
        signer=signer,
        metrics=metrics,
        authenticated=principals is not None,
    )
    if args.http is None:
        server.run("stdio")
        return 0
    host, port = parse_bind(args.http)
    anyio.run(
        lambda: serve_http(server, fence, metrics, host=host, port=port, principals=principals)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
