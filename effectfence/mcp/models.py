"""Pydantic models for every input and output of the MCP server.

Why pydantic here and not in the core: these models *are* the wire contract. ``tools/list``
publishes their JSON schemas, so an agent sees every field typed and described, and the same
models validate what arrives. Inputs are strict (no ``"5"`` for ``5``, no ``true`` for ``1``)
and closed (an unknown field is an error, never silently ignored): a typo in an exactly-once
protocol should fail loudly, before anything is decided.

This module imports only pydantic and the core, never ``mcp``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictInt, StrictStr, WithJsonSchema

from effectfence.cert import CERT_FORMAT
from effectfence.fence import MAX_CLEAR_TEXT
from effectfence.model import MAX_CLOCK_AGENTS, MAX_KNOWN_COUNTER, MAX_NAME_LENGTH, MAX_READ_SET

__all__ = [
    "AbortInput",
    "AbortOutput",
    "CertModel",
    "ClearInput",
    "ClearOutput",
    "CommitInput",
    "CommitOutput",
    "PrepareInput",
    "PrepareInputAuthenticated",
    "PrepareOutput",
    "ReadSetItem",
    "RefusalPayload",
    "ReleaseInput",
    "ReleaseOutput",
    "RenewInput",
    "RenewOutput",
    "ServerInfo",
    "StatsInput",
    "StatsOutput",
    "StatusInput",
    "StatusOutput",
    "VerifyInput",
    "VerifyOutput",
]

#: a ``[domain, seq]`` pair as JSON sends it (an array): lax about list-vs-tuple only,
#: strict about what is inside
ReadPair = Annotated[tuple[StrictStr, StrictInt], Strict(False)]

_Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_LENGTH)]
#: any JSON value, said so in the schema (a bare ``{}`` reads as "forgot to say" to schema
#: linters such as the MCP Inspector's --strict)
JsonValue = Annotated[
    Any,
    WithJsonSchema(
        {"anyOf": [{"type": t} for t in ("object", "array", "string", "number", "boolean", "null")]}
    ),
]
# seqs and clock counters go into RFC 8785 certificates: JSON-safe integers only
_Seq = Annotated[int, Field(ge=0, le=2**53 - 2)]
_Counter = Annotated[StrictInt, Field(ge=0, le=MAX_KNOWN_COUNTER)]
#: the input form of a read-set pair, bounded like the core bounds it
ReadPairIn = Annotated[
    tuple[Annotated[StrictStr, Field(min_length=1, max_length=MAX_NAME_LENGTH)], StrictInt],
    Strict(False),
]
_TICKET_DESC = (
    "The `prepared` ticket exactly as fence_prepare returned it (an authenticated string; "
    "any edit makes it invalid)."
)


class _Input(BaseModel):
    """Strict and closed: wrong types and unknown fields are refused, not coerced."""

    model_config = ConfigDict(strict=True, extra="forbid")


class _Output(BaseModel):
    model_config = ConfigDict(extra="forbid")


# -- shared pieces ---------------------------------------------------------------------------


class ReadSetItem(_Input):
    """When you decided, ``domain`` was at ``seq``."""

    domain: _Name = Field(description="A domain you read before deciding.")
    seq: _Seq = Field(description="Its seq when you read it (as fence_status/cert reported).")


class CertModel(_Output):
    """An effect certificate: proof that one effect ran, and what it returned.

    ``hash`` is the SHA-256 of the RFC 8785 canonical JSON of the other fields; any change
    to any field makes ``fence_verify`` report it.
    """

    model_config = ConfigDict(strict=True, extra="forbid")

    format: str = Field(default=CERT_FORMAT, description="Certificate format version.")
    intent: str = Field(description="The intent this effect fulfilled.")
    parent: str | None = Field(description="Hash of the certificate this one follows, or null.")
    domain: str = Field(description="The contention domain.")
    seq: int = Field(description="The seq reserved in the domain for this effect.")
    tool: str = Field(description="The real tool that ran.")
    args: dict[str, Any] = Field(description="The arguments it ran with.")
    result: JsonValue = Field(description="What it returned (as committed).")
    vector_clock: dict[str, int] = Field(description="Causal clock: agent -> counter.")
    read_set: list[ReadPair] = Field(
        description="[domain, seq] pairs the decision was built on, checked at commit."
    )
    agent: str = Field(description="Who ran it.")
    hash: str = Field(description="Lowercase hex SHA-256 of the canonical certificate body.")


class RefusalPayload(_Output):
    """What every refusal carries, as structured content of an ``isError`` result."""

    code: str = Field(
        description="Stable snake_case code: intent_in_flight, intent_failed, intent_conflict, "
        "read_set_stale, domain_race, lease_lost, invalid_ticket, invalid_request, "
        "store_unavailable."
    )
    message: str = Field(description="What went wrong, naming the operation and state.")
    retryable: bool = Field(description="True if the same call may succeed later.")
    recover: str = Field(description="What to do next.")
    details: dict[str, Any] = Field(
        default_factory=dict,
        description="Context: intent, state, token, holder, retry_after, reason, errors...",
    )


# -- fence_prepare ---------------------------------------------------------------------------


class PrepareInput(_Input):
    """Ask the fence whether to run a side-effecting tool call."""

    intent: _Name = Field(
        description="Stable id of this one logical action, e.g. 'charge:order-123'. Reuse it "
        "on every retry of the same action; never reuse it for a different action."
    )
    domain: _Name = Field(description="Contention scope with a seq counter, e.g. 'order:123'.")
    tool: _Name = Field(description="Name of the real tool you would run, e.g. 'charge_card'.")
    args: dict[str, Any] = Field(
        description="The real tool's arguments (a JSON object), exactly as you will pass them. "
        "Same intent with different tool/args/domain is refused intent_conflict."
    )
    agent: _Name = Field(description="Who is asking (your agent id); recorded in the cert.")
    read_set: list[ReadSetItem | ReadPairIn] | None = Field(
        default=None,
        max_length=MAX_READ_SET,
        description="Optional: domains you read when you decided, as {domain, seq} objects "
        "or [domain, seq] pairs. Refused read_set_stale if any moved (at prepare or commit).",
    )
    parent: _Name | None = Field(
        default=None,
        description="Optional: hash of the cert this effect follows, a certificate of "
        "the same domain (64 lowercase hex; default: the domain's last cert).",
    )
    known_clock: dict[_Name, _Counter] | None = Field(
        default=None,
        max_length=MAX_CLOCK_AGENTS,
        description="Optional: your vector clock (agent -> counter), merged into the cert.",
    )
    expected_seq: _Seq | None = Field(
        default=None,
        description="Optional strict OCC: act only if `domain` is still at this seq; "
        "otherwise refused domain_race.",
    )


class PrepareInputAuthenticated(PrepareInput):
    """fence_prepare over authenticated HTTP: the agent is the caller's principal."""

    agent: _Name | None = Field(  # type: ignore[assignment]
        default=None,
        description="Ignored here: this server authenticates callers, and the certificate "
        "names your principal (the name your bearer token belongs to) as the agent.",
    )


class PrepareOutput(_Output):
    """``fresh``: you hold the intent, run the tool. ``replay``: it already ran, do NOT run it.

    Lean on purpose: this is the hot path, and clients validate every result against this
    schema (the Python SDK's validator costs ~8 us per property present). Optional fields
    are absent, never null, when they do not apply, so their schemas carry no null branch.
    """

    status: Literal["fresh", "replay"] = Field(
        description="fresh = you hold the intent: run the real tool now, then fence_commit "
        "(fence_abort if it may have fired, fence_release if it certainly did not). "
        "replay = it ALREADY RAN: do NOT run it; use `result`."
    )
    intent: str = Field(description="The intent asked about.")
    prepared: Annotated[str | None, WithJsonSchema({"type": "string"})] = Field(
        default=None,
        description="fresh only: the authenticated ticket; pass it unchanged to fence_commit, "
        "fence_abort, fence_release or fence_renew.",
    )
    token: Annotated[int | None, WithJsonSchema({"type": "integer"})] = Field(
        default=None,
        description="fresh only: fencing token (monotonic per intent); a downstream system may "
        "refuse writes carrying a smaller token than it has seen.",
    )
    seq: Annotated[int | None, WithJsonSchema({"type": "integer"})] = Field(
        default=None, description="fresh only: seq reserved in the domain."
    )
    takeover: Annotated[bool | None, WithJsonSchema({"type": "boolean"})] = Field(
        default=None,
        description="fresh only: true if a lapsed lease of another attempt was taken over.",
    )
    lease_expires_in: Annotated[float | None, WithJsonSchema({"type": "number"})] = Field(
        default=None,
        description="fresh only: seconds until the lease lapses; fence_renew to extend it.",
    )
    result: JsonValue = Field(default=None, description="replay only: the recorded result.")
    cert: CertModel | None = Field(
        default=None, description="replay only: the effect's certificate."
    )


# -- ticket operations -------------------------------------------------------------------------


class CommitInput(_Input):
    """Record the real tool's result after it ran."""

    prepared: str = Field(description=_TICKET_DESC)
    result: JsonValue = Field(description="What the real tool returned (any JSON value).")


class CommitOutput(_Output):
    status: Literal["committed"] = Field(
        description="The effect is recorded exactly once; report its result."
    )
    intent: str = Field(description="The intent committed.")
    cert: CertModel = Field(description="The effect's certificate; duplicates replay it.")


class AbortInput(_Input):
    """The real tool failed in a way that may have fired: outcome unknown."""

    prepared: str = Field(description=_TICKET_DESC)
    reason: str = Field(
        default="outcome unknown",
        min_length=1,
        max_length=4096,
        description="Why the outcome is unknown (kept for the operator).",
    )


class AbortOutput(_Output):
    status: Literal["aborted"] = Field(description="The intent is now FAILED (fenced).")
    intent: str = Field(description="The intent aborted.")
    reason: str = Field(description="The recorded reason.")
    next: str = Field(description="What to do next.")


class ReleaseInput(_Input):
    """The real tool certainly did not fire: free the intent for a retry."""

    prepared: str = Field(description=_TICKET_DESC)


class ReleaseOutput(_Output):
    status: Literal["released"] = Field(description="The intent is ABSENT again.")
    intent: str = Field(description="The intent released.")
    next: str = Field(description="What to do next.")


class RenewInput(_Input):
    """Heartbeat for a long-running effect."""

    prepared: str = Field(description=_TICKET_DESC)
    ttl: float | None = Field(
        default=None,
        gt=0,
        le=30 * 24 * 3600,
        allow_inf_nan=False,
        description="Optional: the lease ends this many seconds from now (default: the "
        "server's lease TTL); not added to what is left, so a smaller value shortens it.",
    )


class RenewOutput(_Output):
    status: Literal["renewed"] = Field(description="The lease was extended.")
    intent: str = Field(description="The intent whose lease was extended.")
    lease_expires_in: float = Field(description="Seconds until the lease lapses now.")
    prepared: str = Field(
        description="The ticket with its new deadline; the old one stays valid (same token)."
    )


# -- queries ------------------------------------------------------------------------------------


class StatusInput(_Input):
    """Look at one intent; never creates state."""

    intent: _Name = Field(description="The intent to look up.")


class StatusOutput(_Output):
    intent: str = Field(description="The intent looked up.")
    state: Literal["absent", "in_flight", "in_flight_lapsed", "done", "failed"] = Field(
        description="absent: never ran (or cleared/expired); in_flight: someone holds it; "
        "in_flight_lapsed: its lease lapsed, a prepare takes over; done: it ran (see cert); "
        "failed: outcome unknown, fenced until an operator clears it."
    )
    token: int | None = Field(default=None, description="Current fencing token.")
    holder: str | None = Field(default=None, description="Agent that holds or held it.")
    domain: str | None = Field(default=None, description="Its domain.")
    lease_expires_in: float | None = Field(
        default=None, description="in_flight: seconds of lease left."
    )
    retry_after: float | None = Field(
        default=None, description="in_flight: seconds to wait before retry."
    )
    cert: CertModel | None = Field(default=None, description="done: the certificate.")
    reason: str | None = Field(default=None, description="failed: the abort reason.")
    failed_for: float | None = Field(
        default=None, description="failed: seconds since it was aborted."
    )


class StatsInput(_Input):
    """No arguments."""


class ServerInfo(_Output):
    version: str = Field(description="effectfence version.")
    lease_ttl: float = Field(description="Default lease length, seconds.")
    result_ttl: float | None = Field(
        description="How long results are kept for replay, seconds (null: forever)."
    )
    auto_sweep: bool = Field(description="Whether expired records are reclaimed automatically.")
    clear_enabled: bool = Field(description="Whether fence_clear is registered.")
    idle_sweeps: int = Field(description="Sweeps run by the idle sweeper so far.")


class StatsOutput(_Output):
    attempts: int = Field(description="Every prepare attempt, counted in exactly one bucket.")
    prepare: dict[str, int] = Field(
        description="Prepare attempts by outcome: admitted, replayed, and each refusal code."
    )
    events: dict[str, int] = Field(
        description="commits, aborts, releases, renewals, takeovers, clears, reclaimed, ..."
    )
    store: str = Field(description="Store in use.")
    counters: str = Field(description="Counter table in use: atomic (C11) or pure (Python).")
    counters_info: dict[str, Any] = Field(description="Counter backend details.")
    size: dict[str, int] = Field(description="Records and domains held now.")
    store_info: dict[str, Any] = Field(
        default_factory=dict,
        description="The store's own account of itself: where it is and its durability "
        "settings (SQLite synchronous, PostgreSQL synchronous_commit, Redis persistence with "
        "a verdict on whether acknowledged writes survive a crash).",
    )
    server: ServerInfo = Field(description="This server's configuration.")


#: a chain fence_verify checks in one call: it runs on the server's loop with the memory
#: store, where 10,000 certificates took most of a second (review); trails are the CLI's
MAX_VERIFY_CHAIN = 1_000


class VerifyInput(_Input):
    """Check a certificate, or a chain of them (exactly one of the two)."""

    cert: CertModel | None = Field(default=None, description="One certificate to verify.")
    chain: list[CertModel] | None = Field(
        default=None,
        max_length=MAX_VERIFY_CHAIN,
        description="One domain's certificates in seq order (at most 1,000; `effectfence "
        "certs --verify` checks a whole trail, by the same rule); each one's parent must be "
        "an earlier one's hash (the previous one's, unless attempts overlapped).",
    )


class VerifyOutput(_Output):
    ok: bool = Field(description="True if every hash (and, for a chain, every link) holds.")
    kind: Literal["cert", "chain"] = Field(description="What was verified.")
    length: int = Field(description="Number of certificates checked.")
    broken_at: int | None = Field(
        default=None, description="chain: index of the first bad certificate."
    )
    reason: str = Field(default="", description="Why it failed, if it did.")
    recorded: bool | None = Field(
        default=None,
        description="cert: true if this server currently holds exactly this certificate for "
        "its intent.",
    )


class ClearInput(_Input):
    """Operator reconcile: forget one intent, recorded with who cleared it and why."""

    intent: _Name = Field(description="The intent to clear.")
    reason: str = Field(
        min_length=1,
        max_length=MAX_CLEAR_TEXT,
        pattern=r"\S",
        description="Why it is cleared, e.g. what you found downstream ('refunded by hand, "
        "ticket #81'). Required; recorded in the store's audit trail with who cleared it.",
    )
    force: bool = Field(
        default=False,
        description="Clear even an intent in flight under a live lease. Its holder may be "
        "running the effect right now: force only once you know it is not. Without it such "
        "a clear is refused intent_in_flight.",
    )
    expect_state: Literal["in_flight", "in_flight_lapsed", "done", "failed"] | None = Field(
        default=None,
        description="The state fence_status showed you. If the record is no longer in it "
        "(a lease taken over, a commit or a new failure since), the clear is refused "
        "intent_in_flight and changes nothing: look again.",
    )
    expect_token: StrictInt | None = Field(
        default=None,
        ge=0,
        le=MAX_KNOWN_COUNTER,
        description="The token fence_status showed you; a record under another token is "
        "refused the same way.",
    )


class ClearOutput(_Output):
    """What was cleared, and the audit entry that records it (absent when nothing was)."""

    intent: str = Field(description="The intent.")
    cleared: bool = Field(description="True if there was a record to clear.")
    previous_state: str = Field(description="Its state before clearing.")
    audit_id: Annotated[int | None, WithJsonSchema({"type": "integer"})] = Field(
        default=None, description="cleared only: the id of the audit entry recording it."
    )
    who: Annotated[str | None, WithJsonSchema({"type": "string"})] = Field(
        default=None,
        description="cleared only: who the audit trail names: your principal over "
        "authenticated HTTP, else the transport.",
    )
    reason: Annotated[str | None, WithJsonSchema({"type": "string"})] = Field(
        default=None, description="cleared only: the recorded reason."
    )
    forced: Annotated[bool | None, WithJsonSchema({"type": "boolean"})] = Field(
        default=None,
        description="cleared only: true if force cleared a live lease (recorded as forced).",
    )
