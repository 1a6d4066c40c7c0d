"""Typed refusals: every way the fence says "no", each with a stable code.

The tree::

    FenceError
     └── Refusal                      code, message, retryable, recover, details
          ├── IntentInFlight          intent_in_flight   (retryable, retry_after)
          ├── IntentFailed            intent_failed      (reason, since)
          ├── IntentConflict          intent_conflict    (also ValueError)
          ├── ReadSetStale            read_set_stale     (retryable: re-read, re-decide)
          ├── DomainRace              domain_race        (retryable: re-read, re-decide)
          ├── LeaseLost               lease_lost
          ├── InvalidTicket           invalid_ticket     (also ValueError)
          ├── InvalidRequest          invalid_request    (also ValueError)
          └── StoreUnavailable        store_unavailable  (also ConnectionError)

A refusal carries its context as attributes (``intent``, ``state``, ``token``, ``holder``)
and renders to the same payload the MCP server sends (:meth:`Refusal.to_payload`), so the
library and the wire never disagree about what went wrong or what to do next.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "CLEAR_COMMAND",
    "REFUSAL_TYPES",
    "DomainRace",
    "FenceError",
    "IntentConflict",
    "IntentFailed",
    "IntentInFlight",
    "InvalidRequest",
    "InvalidTicket",
    "LeaseLost",
    "ReadSetStale",
    "Refusal",
    "StoreUnavailable",
]


class FenceError(Exception):
    """Base of every error effectfence raises on purpose."""


class Refusal(FenceError):
    """The fence declined an operation; nothing beyond statistics changed."""

    code: ClassVar[str] = "refusal"
    #: the defaults for the code; one refusal may say otherwise (a stale read set found at
    #: commit is not retryable: the effect already ran)
    retryable: bool = False
    recover: str = ""

    def __init__(
        self,
        message: str,
        *,
        intent: str | None = None,
        state: str | None = None,
        token: int | None = None,
        holder: str | None = None,
        retryable: bool | None = None,
        recover: str | None = None,
        **details: Any,
    ) -> None:
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable
        if recover is not None:
            self.recover = recover
        self.message = message
        self.intent = intent
        self.state = state
        self.token = token
        self.holder = holder
        self.details: dict[str, Any] = details

    def to_payload(self) -> dict[str, Any]:
        """The typed payload of docs/design.md: code, message, retryable, recover, details."""
        details: dict[str, Any] = {
            k: v
            for k, v in (
                ("intent", self.intent),
                ("state", self.state),
                ("token", self.token),
                ("holder", self.holder),
            )
            if v is not None
        }
        details.update(self.details)
        return {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
            "recover": self.recover,
            "details": details,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r})"


class IntentInFlight(Refusal):
    code = "intent_in_flight"
    retryable = True
    recover = "wait and retry after retry_after seconds, or wait for the holder"

    @property
    def retry_after(self) -> float:
        return float(self.details.get("retry_after", 0.0))


#: what an operator runs to clear a fenced intent (the hints name it, in the library and
#: over MCP, since the refused agent cannot clear and its operator may not know how)
CLEAR_COMMAND = "effectfence intents clear INTENT --reason TEXT"


class IntentFailed(Refusal):
    code = "intent_failed"
    recover = (
        "do not run it again: the effect may have run. Reconcile downstream, then an "
        f"operator clears the intent ({CLEAR_COMMAND}; library: fence.clear)"
    )


class IntentConflict(Refusal, ValueError):
    code = "intent_conflict"
    recover = "a different action needs a different intent"


class ReadSetStale(Refusal):
    code = "read_set_stale"
    retryable = True
    recover = "re-read the domains, re-decide, then prepare again"


class DomainRace(Refusal):
    code = "domain_race"
    retryable = True
    recover = "re-read the domain, re-decide, then prepare again"


class LeaseLost(Refusal):
    code = "lease_lost"
    recover = "do not report success; reconcile the effect downstream"


class InvalidTicket(Refusal, ValueError):
    code = "invalid_ticket"
    recover = "fix the call: pass the ticket exactly as prepare returned it"


class InvalidRequest(Refusal, ValueError):
    code = "invalid_request"
    recover = "fix the call"


class StoreUnavailable(Refusal, ConnectionError):
    code = "store_unavailable"
    retryable = True
    recover = "retry later; nothing was decided"


REFUSAL_TYPES: dict[str, type[Refusal]] = {
    cls.code: cls
    for cls in (
        IntentInFlight,
        IntentFailed,
        IntentConflict,
        ReadSetStale,
        DomainRace,
        LeaseLost,
        InvalidTicket,
        InvalidRequest,
        StoreUnavailable,
    )
}
