"""The MCP server: agents route side-effecting tool calls through the fence.

Theory of operation
-------------------
The server is a thin driver around one :class:`~effectfence.EffectFence`. Each tool call is
three steps, and only the middle one can change state:

1. **Validate** the raw arguments against the tool's strict, closed pydantic input model
   (:mod:`effectfence.mcp.models`). Anything malformed becomes an ``invalid_request``
   refusal here, before the fence is touched.
2. **Decide**: one fence operation. Tickets cross the wire sealed by a
   :class:`~effectfence.tickets.TicketSigner` (HMAC over their canonical form); a forged,
   edited or truncated ticket fails to open and is refused ``invalid_ticket`` before the
   fence sees it. A genuine but superseded ticket is refused ``lease_lost`` by the fence.
3. **Render**: a result with structured content (the output model) and a text rendering, or
   for a refusal an ``isError`` result carrying the typed payload (code, message,
   retryable, recover, details) both as structured content and as text.

Every tool declares an output schema that describes BOTH shapes, its answer and the refusal
payload (``anyOf``, the answer first). Clients differ about refusals: the Python SDK skips
validation on ``isError`` results, the TypeScript SDK (and so the MCP Inspector) validates
them too, and turned every refusal into a schema violation while the schemas described
only the answers. Declaring both keeps the typed payload and makes every result valid in
every client.

Who is asking: over stdio (one trusted parent process) and in memory, the caller names its
``agent``. Over authenticated streamable HTTP (:mod:`effectfence.mcp.http`) a bearer token
names a principal, the principal is the certificate's agent whatever the caller typed, and a
ticket prepared by one principal is refused ``invalid_ticket`` to every other.

Why tools are built by hand rather than with ``@server.tool()``: the decorator derives a lax
argument model from the function signature (unknown fields silently ignored, ``"5"``
accepted for ``5``) and pre-parses JSON found inside strings, which would silently turn a
committed string result ``"[1]"`` into a list. We register :class:`Tool` objects whose
published schema is our model's schema and whose function receives the raw arguments.

Fence operations on the memory store take microseconds and never block, so they run inline
on the event loop (no thread hop). On any other store they run on a few worker threads
(:class:`~effectfence.driver.Offloader`), so a slow store never stalls the other agents a
shared server is answering; the read-only tools have threads of their own, so writes
parked on a store lock never keep a read waiting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import logging
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.lowlevel
import pydantic_core
from mcp.server import MCPServer
from mcp.server.context import ServerRequestContext
from mcp.server.mcpserver import Context
from mcp.server.mcpserver.tools import Tool
from mcp.server.mcpserver.utilities.func_metadata import ArgModelBase, FuncMetadata
from mcp_types import CallToolRequestParams, CallToolResult, TextContent, ToolAnnotations
from pydantic import BaseModel, ValidationError

from effectfence import __version__
from effectfence.canonical import floats_back
from effectfence.cert import EffectCert, verify_chain
from effectfence.counters import backend_info
from effectfence.driver import Offloader, release_aside, release_riding_blips
from effectfence.errors import InvalidRequest, InvalidTicket, Refusal, StoreUnavailable
from effectfence.fence import DEFAULT_LEASE_TTL, DEFAULT_RESULT_TTL, EffectFence, FenceConfig
from effectfence.mcp.models import (
    AbortInput,
    AbortOutput,
    CertModel,
    ClearInput,
    ClearOutput,
    CommitInput,
    CommitOutput,
    PrepareInput,
    PrepareInputAuthenticated,
    PrepareOutput,
    ReadSetItem,
    RefusalPayload,
    ReleaseInput,
    ReleaseOutput,
    RenewInput,
    RenewOutput,
    ServerInfo,
    StatsInput,
    StatsOutput,
    StatusInput,
    StatusOutput,
    VerifyInput,
    VerifyOutput,
)
from effectfence.mcp.telemetry import Decision, Metrics, configure_logging
from effectfence.model import PreparedEffect
from effectfence.operator.views import clear_view
from effectfence.store import STORE_ENV, default_store_url
from effectfence.tickets import TICKET_KEY_ENV, TicketSigner

__all__ = [
    "ALLOW_CLEAR_ENV",
    "HTTP_CLEARER",
    "PRINCIPAL_SCOPE_KEY",
    "SERVER_NAME",
    "STDIO_CLEARER",
    "STORE_ENV",
    "build_server",
    "clearer",
    "main",
    "open_fence",
]

SERVER_NAME = "effectfence"
ALLOW_CLEAR_ENV = "EFFECTFENCE_ALLOW_CLEAR"
_MAX_REPORTED_ERRORS = 20
#: the longest a failing idle sweep waits before trying again (seconds)
SWEEP_BACKOFF_MAX = 30.0
#: worker threads of the read-only tools (status, stats, verify), apart from the writers'
READER_THREADS = 2
_log = logging.getLogger(__name__)
#: where the HTTP gate puts the authenticated principal in the ASGI scope of a request
PRINCIPAL_SCOPE_KEY = "effectfence.principal"
#: who fence_clear records when no token names the caller: over stdio (or in memory), and
#: over HTTP on loopback without a tokens file
STDIO_CLEARER = "mcp client (stdio)"
HTTP_CLEARER = "mcp client (http, no token)"

_In = TypeVar("_In", bound=BaseModel)

INSTRUCTIONS = """\
effectfence makes side-effecting tool calls run exactly once across retries, duplicate
dispatches and concurrent agents. Before any side effect (payment, email, provisioning,
write) call fence_prepare with a stable `intent` id for that one logical action:
- status "fresh": run the real tool once, then fence_commit(prepared, result).
  If it failed and MAY have fired: fence_abort(prepared, reason). If it certainly did not
  fire: fence_release(prepared).
- status "replay": it already ran. Do NOT run it again; use `result`.
- an error result: do NOT run the real tool; follow `recover` (intent_in_flight: wait
  retry_after seconds, then prepare again).
Never run the real tool unless fence_prepare answered "fresh" for this intent."""

_PREPARE_DESC = """\
Ask permission BEFORE running a side-effecting tool (payment, email, provisioning, any write
whose duplicate would do harm). Exactly one caller per `intent` is told to run it.

Answers:
- status "fresh": you hold the intent. Run the real tool NOW, once, with exactly
  `args`. Then: it succeeded -> fence_commit(prepared, result). It failed and MAY have fired
  (timeout, crash, ambiguous error) -> fence_abort(prepared, reason). It certainly did NOT
  fire -> fence_release(prepared). A long effect calls fence_renew before lease_expires_in.
- status "replay": the effect ALREADY RAN. Do NOT run the real tool. Use
  `result` (and `cert`) as its outcome.
- error intent_in_flight: another attempt holds it. Do NOT run; wait details.retry_after
  seconds, then call fence_prepare again with the same arguments.
- error intent_failed: outcome unknown. Do NOT run; an operator must reconcile and clear.
- error intent_conflict: this intent was used for a different tool/args/domain. Do NOT run.
- error read_set_stale / domain_race: re-read, re-decide, then prepare again.
- error invalid_request: fix the arguments.
Never run the real tool unless this call answered "fresh"."""

_COMMIT_DESC = """\
Record the result right after the real tool SUCCEEDED, with the `prepared` ticket from
fence_prepare and what the tool returned. The effect is recorded exactly once and every
duplicate fence_prepare of the intent now replays this result. Returns the certificate.
Errors: lease_lost -> your lease was taken over or the intent already finished: do NOT
report success; check fence_status and reconcile. read_set_stale -> the effect ran but a
domain you read moved meanwhile; the intent is now failed: reconcile. store_unavailable ->
the result is NOT recorded yet: call fence_commit again with the same ticket and result (safe
to repeat), and do NOT run the real tool again; if it keeps failing, fence_abort.
invalid_request -> the result can't be recorded (too large, not JSON): the effect RAN, do
NOT run it again; commit a smaller result with the same ticket, or fence_abort.
invalid_ticket -> pass the ticket exactly as fence_prepare returned it."""

_ABORT_DESC = """\
Give up on an effect whose outcome is UNKNOWN: the real tool failed in a way that MAY have
fired (timeout, crash, ambiguous error). The intent becomes failed and every later
fence_prepare of it is refused intent_failed until an operator reconciles what happened and
clears it. Use fence_release instead only if the tool certainly did not fire.
store_unavailable -> call fence_abort again later (safe to repeat); do NOT run the tool."""

_RELEASE_DESC = """\
Free an intent whose effect certainly did NOT fire (the real tool refused before acting, or
you decided not to run it). A later fence_prepare of the intent answers "fresh" again. If you
are not sure whether it fired, use fence_abort instead: a wrong release lets it run twice.
store_unavailable -> call fence_release again later (safe to repeat)."""

_RENEW_DESC = """\
Heartbeat for a long-running real tool: your lease then ends `ttl` seconds from now
(default: the server's lease TTL). It is not added to what is left: a `ttl` shorter than
lease_expires_in shortens the lease. Without it, once lease_expires_in passes another
attempt may take the intent over and your ticket is then refused lease_lost. Refused
lease_lost if that already happened or the intent finished."""

_STATUS_DESC = """\
Look at one intent without changing anything (never creates it): absent, in_flight (held,
with retry_after), in_flight_lapsed (a prepare would take over), done (with its certificate
and result) or failed (outcome unknown, with the reason). Safe to call any time."""

_STATS_DESC = """\
Read the fence's counters: every prepare attempt in exactly one bucket (admitted, replayed,
each refusal code), event counts (commits, aborts, releases, takeovers, ...), the store and
which counter table (C11 atomic or pure Python) runs. Read-only."""

_VERIFY_DESC = """\
Check certificates by recomputing their hashes: pass `cert` (one certificate, as a commit or
replay returned it) or `chain` (one domain's certificates in seq order; each parent an
earlier one's hash). ok=false names what failed. Read-only; runs nothing."""

_CLEAR_DESC = """\
OPERATOR ONLY. Forget one intent (done, failed, or in flight), so a later fence_prepare
answers "fresh" again. Use only after reconciling downstream what actually happened:
clearing a done or failed intent lets its effect run again. `reason` is required (what you
found, e.g. 'refunded by hand, ticket #81') and is recorded in the store's audit trail with
who cleared it (your principal over authenticated HTTP). An intent in flight under a live
lease is refused intent_in_flight: its holder may be running the effect right now; pass
force=true only once you know it is not (recorded as forced). Answers the audit entry's
id, who, reason and forced; cleared=false if the intent had no record."""


class _RawArguments(FuncMetadata):
    """Pass the tool function the raw arguments; validation is ours (see module doc)."""

    def validate_arguments(self, arguments_to_validate: dict[str, Any]) -> dict[str, Any]:
        return {"arguments": arguments_to_validate}


def _text(headline: str, data: dict[str, Any]) -> TextContent:
    body = pydantic_core.to_json(data).decode()
    return TextContent(type="text", text=f"{headline}\n{body}")


def _ok(output: BaseModel, headline: str) -> CallToolResult:
    return _answer(output.model_dump(mode="json", exclude_unset=True), headline)


def _answer(data: dict[str, Any], headline: str) -> CallToolResult:
    """An answer already in its wire form: the hot paths (prepare, commit) build the dict
    their output model describes directly, as a model round trip cost more than the fence
    step itself (tests/test_mcp_server.py validates them against the declared schema)."""
    return CallToolResult(content=[_text(headline, data)], structured_content=data)


def _refused(refusal: Refusal) -> CallToolResult:
    payload: dict[str, Any] = pydantic_core.to_jsonable_python(refusal.to_payload(), fallback=repr)
    headline = (
        f"REFUSED {payload['code']}: {payload['message']}\n"
        f"retryable={str(payload['retryable']).lower()}; recover: {payload['recover']}"
    )
    return CallToolResult(
        content=[_text(headline, payload)], structured_content=payload, is_error=True
    )


def _invalid_arguments(tool: str, exc: ValidationError) -> InvalidRequest:
    """A clear message naming the fields, never echoing the values (they may be secrets)."""
    errors: list[dict[str, str]] = []
    for err in exc.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in err["loc"]) or "(arguments)"
        kind = err["type"]
        if kind == "extra_forbidden":
            problem = "unknown field"
        elif kind == "missing":
            problem = "required field is missing"
        else:
            problem = err["msg"]
        errors.append({"field": where, "problem": problem, "type": kind})
    shown = "; ".join(f"{e['field']}: {e['problem']}" for e in errors[:5])
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return InvalidRequest(
        f"{tool}: invalid arguments: {shown}{more}",
        errors=errors[:_MAX_REPORTED_ERRORS],
    )


def _output_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's answer, or a refusal: what a tool really sends, so every client's
    validator accepts every result (see the module doc). The answer comes first (a
    validator that stops at the first branch that holds pays nothing extra for it); the
    answer's ``$defs`` move to the top, where its ``$ref``s still resolve."""
    answer = model.model_json_schema(mode="serialization")
    defs = answer.pop("$defs", None)
    refusal = RefusalPayload.model_json_schema(mode="serialization")
    refusal["required"] = sorted(RefusalPayload.model_fields)  # always sent, all of it
    name = answer.get("title", model.__name__)
    schema: dict[str, Any] = {
        "type": "object",
        "title": f"{name} or Refusal",
        "description": f"The answer ({name}), or, on an isError result, a typed refusal: "
        "code, message, retryable, recover, details.",
        "anyOf": [answer, refusal],
    }
    if defs:
        schema["$defs"] = defs
    return schema


def _request_scope(ctx: Context[Any, Any] | None) -> dict[str, Any] | None:
    """The ASGI scope of the HTTP request behind this call; None over stdio, in memory, or
    when called directly (no request)."""
    if ctx is None:
        return None
    # Context.request_context reads a pydantic private attribute twice, each through
    # BaseModel.__getattr__: ~3 us a call, more than the fence's own step on the memory
    # store. The attribute is read once from the private dict where pydantic keeps it; the
    # property stays the way when that dict does not hold it (another SDK or pydantic).
    private = getattr(ctx, "__pydantic_private__", None)
    found = private.get("_request_context", _ABSENT) if isinstance(private, dict) else _ABSENT
    if found is _ABSENT:
        try:
            found = ctx.request_context
        except ValueError:  # no request context: a direct call
            return None
    return _scope_of(getattr(found, "request", None))


def _scope_of(request: Any) -> dict[str, Any] | None:
    """The ASGI scope of an HTTP request (a Starlette Request); None for no request."""
    scope = getattr(request, "scope", None)
    return scope if isinstance(scope, dict) else None


_ABSENT = object()


def _release_inline(fence: EffectFence, ticket: Any) -> BaseException | None:
    """Release ``ticket`` here, on the loop (no worker thread could be had); its error."""
    try:
        fence.release(ticket)
    except Exception as exc:  # a refusal or the store's fault: logged, as after_cancel
        return exc
    return None


def _decision(tool: str, scope: dict[str, Any] | None) -> Decision:
    """A call's :class:`Decision`: the principal the HTTP gate authenticated for the
    request whose ASGI ``scope`` this is (None without one), and whether it came over HTTP."""
    principal = None if scope is None else scope.get(PRINCIPAL_SCOPE_KEY)
    d = Decision(tool, principal if isinstance(principal, str) else None)
    d.transport = "stdio" if scope is None else "http"
    return d


def clearer(d: Decision) -> str:
    """Who ``fence_clear`` records in the audit trail: the token's principal over
    authenticated HTTP, else the transport (no one is named there). "(mcp)" says where
    the clear came from, as the console's entries say "(console)"."""
    if d.principal is not None:
        return f"{d.principal} (mcp)"
    if d.transport == "http":
        return HTTP_CLEARER
    return STDIO_CLEARER


_Op = Callable[[_In, Decision], CallToolResult]
#: a fence tool's call: raw arguments and the request's ASGI scope (None off HTTP) to result
_Call = Callable[[dict[str, Any], "dict[str, Any] | None"], Awaitable[CallToolResult]]


def _tool(
    name: str,
    title: str,
    description: str,
    input_model: type[_In],
    output_model: type[BaseModel],
    annotations: ToolAnnotations,
    op: _Op[_In],
    tools: _FenceTools,
    on_invalid: Callable[[], None] | None = None,
) -> tuple[Tool, _Call]:
    """``op`` as a tool under ``name`` with the models' schemas, and as the call
    :class:`_FenceServer` makes directly; refusals become results.

    ``on_invalid`` runs when the arguments are refused before the fence sees them (so a
    malformed fence_prepare is still counted as an attempt). Every call, answered or
    refused, is one :class:`Decision`: logged and counted once."""
    offload = tools.offload
    # reads on threads of their own: parked writes (a store lock held elsewhere) must not
    # keep fence_status waiting, found by review; a read never waits for a write here
    read_only = bool(annotations.read_only_hint)

    async def call(arguments: dict[str, Any], scope: dict[str, Any] | None) -> CallToolResult:
        decision = _decision(name, scope)
        try:
            try:
                request = input_model.model_validate(arguments)
            except ValidationError as exc:
                if on_invalid is not None:
                    on_invalid()
                raise _invalid_arguments(name, exc) from None
            if offload:
                result: CallToolResult = await tools.off_loop_to_the_end(
                    op, request, decision, read_only
                )
            else:
                result = op(request, decision)
        except Refusal as refusal:
            decision.outcome = refusal.code
            result = _refused(refusal)
        decision.log()
        tools.metrics.observe(decision)
        return result

    async def run(arguments: dict[str, Any], ctx: Context[Any, Any] | None = None) -> Any:
        return await call(arguments, _request_scope(ctx))

    run.__name__ = name
    meta = _RawArguments(arg_model=ArgModelBase, output_schema=_output_schema(output_model))
    tool = Tool(
        fn=run,
        name=name,
        title=title,
        description=description,
        parameters=input_model.model_json_schema(),
        fn_metadata=meta,
        is_async=True,
        context_kwarg="ctx",
        annotations=annotations,
    )
    return tool, call


class _FenceServer(MCPServer[None]):
    """An :class:`MCPServer` that calls its fence tools directly.

    The SDK's ``tools/call`` handler builds a :class:`Context` (a pydantic model) for every
    call, then looks the tool up, re-validates nothing (our arguments are raw) and converts
    nothing (our results are built): inside a serving process that machinery cost ~15 us a
    fresh ``fence_prepare``, some 4% of a call over HTTP (benchmarks/bench_mcp.py). A fence
    tool needs only its arguments and the request's scope, so this handler passes those to
    the tool's call; any other tool (one a caller added) takes the SDK's way. Should an SDK
    stop calling this method, every call takes the SDK's way: slower, the same answers
    (tests/test_mcp_server.py fails then, so it is noticed)."""

    def __init__(
        self, *args: Any, fence_calls: dict[str, tuple[Tool, _Call]], **kwargs: Any
    ) -> None:
        self._fence_calls = fence_calls
        self.fast_calls = 0  # fence tool calls made directly (read by a test)
        super().__init__(*args, **kwargs)

    async def _handle_call_tool(
        self, ctx: ServerRequestContext[None], params: CallToolRequestParams
    ) -> Any:
        tool, call = self._fence_calls.get(params.name, (None, None))
        # only while the tool registered under that name is still ours: a fence tool
        # removed (remove_tool) answered anyway, and a removed fence_clear cleared a done
        # intent whose effect then ran again; one put in its place was never called
        # (found by review)
        manager = getattr(self, "_tool_manager", None)
        if call is None or manager is None or manager.get_tool(params.name) is not tool:
            return await super()._handle_call_tool(ctx, params)
        self.fast_calls += 1
        try:
            return await call(params.arguments or {}, _scope_of(ctx.request))
        except Exception:
            # a refusal is already a result: this is a fault, answered as the SDK answers
            # one (its text stays on the server, in the log)
            _log.exception("tool %r raised an unexpected exception", params.name)
            text = f"Error executing tool {params.name}"
            return CallToolResult(content=[TextContent(type="text", text=text)], is_error=True)


def _annotations(
    title: str, *, read_only: bool = False, destructive: bool = False, idempotent: bool = False
) -> ToolAnnotations:
    # open_world is False for all: the fence only touches its own store, never the world.
    return ToolAnnotations(
        title=title,
        read_only_hint=read_only,
        destructive_hint=destructive,
        idempotent_hint=idempotent,
        open_world_hint=False,
    )


def _cert(cert: EffectCert) -> dict[str, Any]:
    """The certificate as :class:`CertModel` describes it: its JSON form is exactly that
    (cert_body's fields in the model's order, read_set as [domain, seq] lists)."""
    return cert.to_dict()


class _FenceTools:
    """The tool operations, bound to one fence and one signer.

    Each operation takes its validated input and the call's :class:`Decision`, which it
    fills in (intent, domain, token, outcome, time in the fence) for the log and metrics."""

    def __init__(
        self,
        fence: EffectFence,
        signer: TicketSigner,
        clear_enabled: bool,
        *,
        metrics: Metrics,
        authenticated: bool,
    ) -> None:
        self.fence = fence
        self.signer = signer
        self.clear_enabled = clear_enabled
        self.metrics = metrics
        self.authenticated = authenticated
        # the memory store answers in microseconds without blocking: a thread hop would
        # cost more than the call; any other store may block, so it runs off the loop
        self.offload = fence.store.name != "memory"
        self.offloader = Offloader(name="effectfence-mcp")
        self.readers = Offloader(READER_THREADS, name="effectfence-mcp-read")
        self._background: set[asyncio.Future[Any]] = set()  # releases after a cancel
        self.idle_sweeps = 0

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A blocking store step, off the event loop: on our own worker threads under
        asyncio (cheaper per call than a general pool, see :class:`Offloader`), through
        anyio's pool under any other backend."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # not asyncio (trio): no loop of asyncio's to hand back to
            return await anyio.to_thread.run_sync(fn, *args)
        return await self.offloader.run(fn, *args)

    async def off_loop_to_the_end(
        self, op: Callable[..., Any], req: Any, d: Decision, read_only: bool = False
    ) -> Any:
        """:meth:`off_loop` for a tool call (a read-only one on the readers' threads). A
        caller that goes away (a cancel) while the step runs does not stop the step: it
        finishes in its thread, and is then logged and counted like any other
        (:meth:`after_cancel`)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # not asyncio (trio): the same, with anyio's shield (review)
            with anyio.CancelScope(shield=True):
                result = await self.off_loop(op, req, d)
            try:
                await anyio.lowlevel.checkpoint_if_cancelled()
            except anyio.get_cancelled_exc_class():
                if not read_only:
                    with anyio.CancelScope(shield=True):
                        await self._undelivered(d)
                raise
            return result
        if read_only:
            return await self.readers.run(op, req, d)  # a read: nothing to finish or log
        # queued on a worker now, a future and not a task: a shutdown cancelling every
        # task cancelled the task carrying a prepare that went on in its worker, and
        # after_cancel let its fresh ticket be, held by nobody (found by review)
        job = self.offloader.submit(op, req, d)
        try:
            result = await asyncio.shield(job)
            # a cancel that came after the step finished but before this task resumed is
            # not delivered at the await (its future was done): the SDK then drops the
            # answer, and a fresh ticket nobody received stayed held (found by review)
            await anyio.lowlevel.checkpoint_if_cancelled()
            return result
        except asyncio.CancelledError:
            job.add_done_callback(functools.partial(self.after_cancel, d))
            raise

    def after_cancel(self, d: Decision, job: asyncio.Future[Any]) -> None:
        """The step of a call whose caller went away finished: log and count it (it was
        lost from both, found by review). A fresh ticket its caller never received is
        released: the effect cannot have run, and the intent would otherwise stay held by
        nobody until its lease lapsed."""
        if job.cancelled():
            return
        error = job.exception()
        if isinstance(error, Refusal):
            d.outcome = error.code
        elif error is not None:
            return  # a fault of the step's: raised to nobody; the SDK logs its own
        d.log()
        self.metrics.observe(d)
        ticket = d.ticket
        if ticket is not None and d.outcome in ("fresh", "takeover"):
            loop = asyncio.get_running_loop()

            def note(failed: BaseException | None) -> None:  # in a thread: on the loop
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody counts
                    loop.call_soon_threadsafe(self._note_release, d, failed)

            def released(step: asyncio.Future[Any]) -> None:
                failed = step.exception() if not step.cancelled() else None
                if isinstance(failed, StoreUnavailable) and failed.retryable:
                    release_aside(self.fence, ticket, note)  # a blip: ridden out
                    return
                self._note_release(d, failed)

            # queued in a worker thread now, not handed to a task: a shutdown cancelling
            # every task could reach that task before its first step, and the ticket stayed
            # held by nobody until its lease lapsed (the driver's own case, found by review)
            try:
                step = self.offloader.submit(self.fence.release, ticket)
            except RuntimeError:  # no thread to be had: nobody else will release it
                self._note_release(d, _release_inline(self.fence, ticket))
                return
            step.add_done_callback(released)
            self._background.add(step)
            step.add_done_callback(self._background.discard)

    async def _undelivered(self, d: Decision) -> None:
        """:meth:`after_cancel` for a finished step, in the cancelled task itself (trio)."""
        d.log()
        self.metrics.observe(d)
        ticket = d.ticket
        if ticket is None or d.outcome not in ("fresh", "takeover"):
            return
        # a limiter of its own: in anyio's shared one (40 threads), releases pausing through
        # an outage held up every other call's steps, renewals included (found by review)
        failed = await anyio.to_thread.run_sync(
            release_riding_blips, self.fence, ticket, limiter=anyio.CapacityLimiter(1)
        )
        self._note_release(d, failed)

    def _note_release(self, d: Decision, failed: BaseException | None) -> None:
        """Log and count the release of a fresh ticket its caller never received."""
        assert d.ticket is not None
        undelivered = Decision("fence_release", d.principal)
        undelivered.transport = d.transport
        undelivered.intent, undelivered.domain = d.intent, d.domain
        undelivered.token = d.ticket.token
        undelivered.outcome = "released" if failed is None else getattr(failed, "code", "error")
        undelivered.log()
        self.metrics.observe(undelivered)

    @staticmethod
    def _lease_left(granted: float, since: float) -> float:
        """Seconds the lease surely has left: a step that began after ``since``
        (``perf_counter``) granted it ``granted`` s on the store's clock. No store read: on a
        server store that read was a round trip on every fresh prepare and renew."""
        return max(0.0, granted - (time.perf_counter() - since))

    def _agent(self, req: PrepareInput, d: Decision) -> str:
        if d.principal is not None:
            return d.principal  # who the token says, whatever the caller typed
        if self.authenticated:
            raise InvalidRequest("fence_prepare: this server requires an authenticated principal")
        if req.agent is None:
            raise InvalidRequest("fence_prepare: invalid arguments: agent: required field missing")
        return req.agent

    def _open(self, op: str, wire: str, d: Decision) -> PreparedEffect:
        """Open a sealed ticket; over authenticated HTTP only its own principal may use it."""
        ticket = self.signer.open(wire)
        d.intent, d.domain, d.token = ticket.intent, ticket.domain, ticket.token
        if d.principal is not None and ticket.agent != d.principal:
            raise InvalidTicket(
                f"can't {op}: this ticket was prepared by another principal",
                intent=ticket.intent,
            )
        return ticket

    def prepare(self, req: PrepareInput, d: Decision) -> CallToolResult:
        d.intent, d.domain = req.intent, req.domain
        agent = self._agent(req, d)
        rs = req.read_set  # None when empty: fence.request's plain call is built in C
        read_set = (
            [(e.domain, e.seq) if isinstance(e, ReadSetItem) else e for e in rs] if rs else None
        )
        t0 = time.perf_counter()
        try:
            admission = self.fence.request(
                req.intent,
                req.domain,
                req.tool,
                req.args,
                agent,
                read_set=read_set,
                parent=req.parent,
                known_clock=req.known_clock,
                expected_seq=req.expected_seq,
            )
        finally:
            d.latency = time.perf_counter() - t0
        if admission.fresh:
            ticket = admission.ticket
            try:
                sealed = self.signer.seal(ticket)
            except InvalidRequest:
                # Never answer "fresh" with a ticket this server would refuse at commit:
                # nothing has run yet, so the claim is released (it certainly did not fire).
                self.fence.release(ticket)
                raise
            takeover = bool(getattr(admission, "takeover", False))
            d.outcome, d.token = ("takeover" if takeover else "fresh"), ticket.token
            d.ticket = ticket
            data = {
                "status": "fresh",
                "intent": ticket.intent,
                "prepared": sealed,
                "token": ticket.token,
                "seq": ticket.seq,
                "takeover": takeover,
                "lease_expires_in": self._lease_left(self.fence.config.lease_ttl, t0),
            }
            return _answer(
                data,
                f"FRESH: you hold intent {ticket.intent!r}. Run {ticket.tool!r} now with exactly "
                "these args, then fence_commit with `prepared` and its result (fence_abort if "
                "it may have fired, fence_release if it certainly did not).",
            )
        cert = admission.cert
        d.outcome = "replay"
        data = {
            "status": "replay",
            "intent": cert.intent,
            "result": cert.result,
            "cert": _cert(cert),
        }
        return _answer(
            data,
            f"REPLAY: {cert.tool!r} ALREADY RAN for intent {cert.intent!r}. Do NOT run it "
            "again; its recorded outcome is `result`.",
        )

    def commit(self, req: CommitInput, d: Decision) -> CallToolResult:
        ticket = self._open("commit", req.prepared, d)
        t0 = time.perf_counter()
        try:
            cert = self.fence.commit(ticket, req.result)
        finally:
            d.latency = time.perf_counter() - t0
        d.outcome = "committed"
        data = {"status": "committed", "intent": cert.intent, "cert": _cert(cert)}
        return _answer(
            data,
            f"COMMITTED: {cert.intent!r} is recorded exactly once; duplicates will replay it.",
        )

    def abort(self, req: AbortInput, d: Decision) -> CallToolResult:
        ticket = self._open("abort", req.prepared, d)
        t0 = time.perf_counter()
        try:
            self.fence.abort(ticket, req.reason)
        finally:
            d.latency = time.perf_counter() - t0
        d.outcome = "aborted"
        out = AbortOutput(
            status="aborted",
            intent=ticket.intent,
            reason=req.reason,
            next="The intent is fenced (failed) until an operator reconciles and clears it.",
        )
        return _ok(out, f"ABORTED: {ticket.intent!r} is fenced; outcome unknown.")

    def release(self, req: ReleaseInput, d: Decision) -> CallToolResult:
        ticket = self._open("release", req.prepared, d)
        t0 = time.perf_counter()
        try:
            self.fence.release(ticket)
        finally:
            d.latency = time.perf_counter() - t0
        d.outcome = "released"
        out = ReleaseOutput(
            status="released",
            intent=ticket.intent,
            next="The intent is free: a later fence_prepare answers fresh.",
        )
        return _ok(out, f"RELEASED: {ticket.intent!r} is free for a retry.")

    def renew(self, req: RenewInput, d: Decision) -> CallToolResult:
        ticket = self._open("renew", req.prepared, d)
        t0 = time.perf_counter()
        try:
            self.fence.renew(ticket, req.ttl)
        finally:
            d.latency = time.perf_counter() - t0
        d.outcome = "renewed"
        out = RenewOutput(
            status="renewed",
            intent=ticket.intent,
            lease_expires_in=self._lease_left(
                self.fence.config.lease_ttl if req.ttl is None else req.ttl, t0
            ),
            prepared=self.signer.seal(ticket),
        )
        return _ok(out, f"RENEWED: lease on {ticket.intent!r} extended.")

    def status(self, req: StatusInput, d: Decision) -> CallToolResult:
        d.intent = req.intent
        t0 = time.perf_counter()
        try:
            st = self.fence.intent_status(req.intent)
        finally:
            d.latency = time.perf_counter() - t0
        d.outcome, d.domain, d.token = st.state, st.domain, st.token
        now = self.fence.store.now()
        fields: dict[str, Any] = {
            "token": st.token,
            "holder": st.holder,
            "domain": st.domain,
            "retry_after": st.retry_after,
            "reason": st.reason,
        }
        if st.lease_until is not None:
            fields["lease_expires_in"] = max(0.0, st.lease_until - now)
        if st.since is not None:
            fields["failed_for"] = max(0.0, now - st.since)
        if st.cert is not None:
            fields["cert"] = _cert(st.cert)
        fields = {k: v for k, v in fields.items() if v is not None}
        out = StatusOutput.model_validate({"intent": st.intent, "state": st.state, **fields})
        return _ok(out, f"STATUS: {st.intent!r} is {st.state}.")

    def stats(self, req: StatsInput, d: Decision) -> CallToolResult:
        d.outcome = "ok"
        s = self.fence.stats()
        cfg = self.fence.config
        events = {k: v for k, v in s.items() if k != "attempts" and type(v) is int}
        out = StatsOutput(
            attempts=s["attempts"],
            prepare=s["prepare"],
            events=events,
            store=s["store"],
            counters=s["counters"],
            counters_info=backend_info(),
            size=s["size"],
            # said in the docs, missing until review: whether this store keeps what it
            # acknowledged (Redis's persistence verdict above all)
            store_info=self.fence.store.describe(),
            server=ServerInfo(
                version=__version__,
                lease_ttl=cfg.lease_ttl,
                result_ttl=None if math.isinf(cfg.result_ttl) else cfg.result_ttl,
                auto_sweep=cfg.auto_sweep,
                clear_enabled=self.clear_enabled,
                idle_sweeps=self.idle_sweeps,
            ),
        )
        return _ok(out, f"STATS: {s['attempts']} prepare attempts.")

    def verify(self, req: VerifyInput, d: Decision) -> CallToolResult:
        if (req.cert is None) == (req.chain is None):
            raise InvalidRequest("fence_verify: pass exactly one of `cert` or `chain`")
        if req.cert is not None:
            out = self._verify_one(req.cert)
        else:
            assert req.chain is not None
            try:
                certs = [EffectCert.from_dict(floats_back(c.model_dump())) for c in req.chain]
            except InvalidRequest as exc:
                out = VerifyOutput(ok=False, kind="chain", length=len(req.chain), reason=str(exc))
            else:
                rep = verify_chain(certs)
                out = VerifyOutput(
                    ok=rep.ok,
                    kind="chain",
                    length=rep.length,
                    broken_at=rep.broken_at,
                    reason=rep.reason,
                )
        verdict = "OK" if out.ok else "BROKEN"
        d.outcome = "ok" if out.ok else "broken"
        return _ok(out, f"VERIFY {out.kind}: {verdict}{': ' + out.reason if out.reason else ''}")

    def _verify_one(self, model: CertModel) -> VerifyOutput:
        try:
            # read by the client's JSON parser: a float such as 1e16, written without a
            # fraction as canonical JSON writes it, came back an int (found by review)
            cert = EffectCert.from_dict(floats_back(model.model_dump()))
        except InvalidRequest as exc:
            return VerifyOutput(ok=False, kind="cert", length=1, reason=str(exc), recorded=False)
        if not cert.verify():
            reason = "the hash does not match the certificate's fields (tampered or corrupted)"
            return VerifyOutput(ok=False, kind="cert", length=1, reason=reason, recorded=False)
        try:
            held = self.fence.intent_status(cert.intent).cert
        except InvalidRequest:
            held = None
        recorded = held is not None and held.hash == cert.hash
        return VerifyOutput(ok=True, kind="cert", length=1, reason="", recorded=recorded)

    def clear(self, req: ClearInput, d: Decision) -> CallToolResult:
        d.intent = req.intent
        t0 = time.perf_counter()
        try:
            entry = self.fence.clear(
                req.intent,
                reason=req.reason,
                who=clearer(d),
                force=req.force,
                expect_state=req.expect_state,
                expect_token=req.expect_token,
            )
        finally:
            d.latency = time.perf_counter() - t0
        out = ClearOutput.model_validate(clear_view(req.intent, entry))
        if entry is None:
            d.outcome = "absent"
            return _ok(out, f"NOTHING TO CLEAR: {req.intent!r} has no record.")
        d.outcome = "cleared"
        d.domain, d.token = entry.previous.get("domain"), entry.previous.get("token")
        forced = " (forced)" if entry.forced else ""
        return _ok(
            out,
            f"CLEARED{forced}: {req.intent!r} (was {out.previous_state}); audit entry "
            f"#{entry.id} records {entry.who} and the reason.",
        )

    async def sweep_forever(self) -> None:
        """Reclaim expired records while the server idles (prepare also sweeps on its way).

        A failed sweep never ends the loop: escaping the lifespan's task group, it ended
        the lifespan and every later /mcp request with it. Failures back off and are logged
        on a change of state only (failing, recovered), so an outage does not flood the log."""
        cfg = self.fence.config
        delay = cfg.sweep_interval
        failures = 0
        while True:
            await anyio.sleep(delay)
            try:
                if self.offload:
                    await anyio.to_thread.run_sync(self.fence.sweep, cfg.sweep_batch)
                else:
                    self.fence.sweep(cfg.sweep_batch)
            except Exception as exc:
                if not failures:
                    _log.warning(
                        "idle sweep failed, retrying with back-off (logged again once it "
                        "recovers): %s: %s",
                        type(exc).__name__,
                        exc,
                        # a store outage is expected; anything else is a bug worth its trace
                        exc_info=not isinstance(exc, StoreUnavailable),
                    )
                failures += 1
                delay = min(delay * 2, max(cfg.sweep_interval, SWEEP_BACKOFF_MAX))
                continue
            if failures:
                _log.warning("idle sweep recovered after %d failed attempts", failures)
                failures, delay = 0, cfg.sweep_interval
            self.idle_sweeps += 1


def build_server(
    fence: EffectFence | None = None,
    *,
    allow_clear: bool = False,
    signer: TicketSigner | None = None,
    metrics: Metrics | None = None,
    authenticated: bool = False,
    freeze_heap: bool = False,
) -> MCPServer[None]:
    """An MCP server exposing ``fence`` (a fresh in-memory fence by default).

    ``fence_clear`` is registered only with ``allow_clear``. Tickets are sealed by
    ``signer`` (default: key from ``EFFECTFENCE_TICKET_KEY``, else the store's sealing key,
    so every server sharing a durable store opens every other's tickets).
    Calls are counted in ``metrics`` (give one to read it, e.g. for ``/metrics``).
    ``authenticated``: every call must carry a principal (the HTTP gate's), which is the
    certificate's agent; ``agent`` becomes optional and is ignored.
    ``freeze_heap``: for the process that runs the server (``effectfence serve``), see
    :func:`_freeze_heap`; it changes the whole process's collector, so off by default.
    """
    fence = fence if fence is not None else EffectFence()
    if signer is None:
        signer = TicketSigner.for_store(fence.store)
    tools = _FenceTools(
        fence,
        signer,
        allow_clear,
        metrics=metrics if metrics is not None else Metrics(),
        authenticated=authenticated,
    )
    prepare_input: type[PrepareInput] = PrepareInputAuthenticated if authenticated else PrepareInput

    @asynccontextmanager
    async def lifespan(app: MCPServer[None]) -> AsyncIterator[None]:
        if freeze_heap:
            _freeze_heap()
        async with anyio.create_task_group() as tg:
            if fence.config.auto_sweep:
                tg.start_soon(tools.sweep_forever)
            try:
                yield None
            finally:
                tg.cancel_scope.cancel()
                tools.offloader.close()
                tools.readers.close()

    registered = [
        _tool(
            "fence_prepare",
            "Prepare a side effect",
            _PREPARE_DESC,
            prepare_input,
            PrepareOutput,
            # not idempotent: a repeat after the lease lapsed takes the intent over
            _annotations("Prepare a side effect"),
            tools.prepare,
            tools,
            on_invalid=lambda: fence.count_refused_prepare("invalid_request"),
        ),
        _tool(
            "fence_commit",
            "Commit a side effect's result",
            _COMMIT_DESC,
            CommitInput,
            CommitOutput,
            # a repeated commit with the same ticket is refused and changes nothing
            _annotations("Commit a side effect's result", idempotent=True),
            tools.commit,
            tools,
        ),
        _tool(
            "fence_abort",
            "Abort: outcome unknown",
            _ABORT_DESC,
            AbortInput,
            AbortOutput,
            # replaces the live lease with a fence that blocks every retry
            _annotations("Abort: outcome unknown", destructive=True, idempotent=True),
            tools.abort,
            tools,
        ),
        _tool(
            "fence_release",
            "Release: it did not fire",
            _RELEASE_DESC,
            ReleaseInput,
            ReleaseOutput,
            # deletes the in-flight record
            _annotations("Release: it did not fire", destructive=True, idempotent=True),
            tools.release,
            tools,
        ),
        _tool(
            "fence_renew",
            "Renew a lease",
            _RENEW_DESC,
            RenewInput,
            RenewOutput,
            _annotations("Renew a lease", idempotent=True),
            tools.renew,
            tools,
        ),
        _tool(
            "fence_status",
            "Intent status",
            _STATUS_DESC,
            StatusInput,
            StatusOutput,
            _annotations("Intent status", read_only=True, idempotent=True),
            tools.status,
            tools,
        ),
        _tool(
            "fence_stats",
            "Fence statistics",
            _STATS_DESC,
            StatsInput,
            StatsOutput,
            _annotations("Fence statistics", read_only=True, idempotent=True),
            tools.stats,
            tools,
        ),
        _tool(
            "fence_verify",
            "Verify certificates",
            _VERIFY_DESC,
            VerifyInput,
            VerifyOutput,
            _annotations("Verify certificates", read_only=True, idempotent=True),
            tools.verify,
            tools,
        ),
    ]
    if allow_clear:
        registered.append(
            _tool(
                "fence_clear",
                "Clear an intent (operator)",
                _CLEAR_DESC,
                ClearInput,
                ClearOutput,
                _annotations("Clear an intent (operator)", destructive=True, idempotent=True),
                tools.clear,
                tools,
            )
        )
    return _FenceServer(
        SERVER_NAME,
        title="effectfence",
        instructions=INSTRUCTIONS,
        version=__version__,
        tools=[tool for tool, _ in registered],
        lifespan=lifespan,
        log_level="WARNING",
        fence_calls={tool.name: (tool, call) for tool, call in registered},
    )


def _freeze_heap() -> None:
    """Once the transport is up, before the first call: collect, then freeze what is alive.

    A server process holds some 100k objects from its imports and setup (the SDK, pydantic
    schemas, uvicorn) that live as long as it does, and every full (generation 2) pass of
    the cyclic collector scanned them all: ~55 ms a pass on a 2-core machine, several a
    second under load, each one stalling every call in flight (8 HTTP clients: p99 ~60 ms,
    against ~8 ms frozen). Frozen objects are still freed by reference counting; only a
    cycle among them would wait for the process to end."""
    gc.collect()
    gc.freeze()


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def open_fence(store_url: str, config: FenceConfig) -> EffectFence:
    """The one place ``serve`` builds its fence from a store URL.

    Raises ValueError (with a message fit for the command line, never echoing credentials)
    for a store this build cannot open."""
    from effectfence.store import StoreURLError

    try:
        return EffectFence.from_url(store_url, config)
    except StoreURLError as exc:
        raise ValueError(str(exc)) from exc


def main(argv: list[str] | None = None) -> int:
    """``effectfence serve``: run the fence as an MCP server, over stdio until stdin closes,
    or over streamable HTTP (``--http``) until interrupted."""
    parser = argparse.ArgumentParser(
        prog="effectfence serve",
        description="Run the effectfence MCP server: over stdio (default, one agent process) "
        "or streamable HTTP (--http, many agents sharing one fence).",
    )
    parser.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="where intents live: sqlite:///path/fence.db, postgresql://..., redis://..., or "
        f"memory: (no durability). Default: ${STORE_ENV}, else one SQLite file in the user's "
        "state directory, shared by every server on this host.",
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=DEFAULT_LEASE_TTL,
        metavar="S",
        help=f"seconds a prepared ticket holds its intent (default {DEFAULT_LEASE_TTL:g})",
    )
    parser.add_argument(
        "--result-ttl",
        type=float,
        default=DEFAULT_RESULT_TTL,
        metavar="S",
        help=f"seconds a committed result is replayed (default {DEFAULT_RESULT_TTL:g})",
    )
    parser.add_argument(
        "--allow-clear",
        action="store_true",
        default=_env_flag(ALLOW_CLEAR_ENV),
        help=f"register the operator tool fence_clear (or set {ALLOW_CLEAR_ENV}=1)",
    )
    parser.add_argument(
        "--http",
        metavar="[HOST:]PORT",
        help="serve streamable HTTP at http://HOST:PORT/mcp (HOST defaults to 127.0.0.1; "
        "PORT 0 picks a free one), with /healthz and /metrics",
    )
    parser.add_argument(
        "--tokens",
        type=Path,
        metavar="FILE",
        help="HTTP bearer tokens, one 'principal token' (or 'principal sha256:HEX') a line; "
        "every request must carry one, and the principal is the certificates' agent. "
        "Required to bind a non-loopback address. SIGHUP reads the file again.",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="HOST[:PORT]",
        help="HTTP: a further Host header to accept (DNS-rebinding protection admits only "
        "loopback names and the bound address otherwise); repeatable",
    )
    parser.add_argument(
        "--console",
        action="store_true",
        help="HTTP: serve the operator's console at /console/ on the same server (behind the "
        "same tokens: a browser logs in with one), charting this server's fence_stats "
        "counters; it clears intents only with --allow-clear",
    )
    parser.add_argument(
        "--show-payload",
        action="store_true",
        help="console: show intents' args and results (they may hold personal data)",
    )
    parser.add_argument(
        "--log-level",
        choices=["off", "debug", "info", "warning"],
        default=None,
        help="one JSON line per decision on stderr at INFO (default: off over stdio, "
        "info over HTTP); never the args or the result",
    )
    args = parser.parse_args(argv)
    bind = None
    principals = None
    if args.http is not None:
        from effectfence.mcp import http

        try:
            bind = http.parse_bind(args.http)
            if args.tokens is not None:
                principals = http.Principals.load(args.tokens)
            http.check_exposure(bind[0], principals)
        except ValueError as exc:
            parser.error(str(exc))
    elif args.tokens is not None or args.allow_host or args.console:
        parser.error("--tokens, --allow-host and --console apply to --http only")
    if args.show_payload and not args.console:
        parser.error("--show-payload applies to --console only")
    if args.store is not None and not args.store.strip():
        # an unset shell variable, say: never the shared default ledger by accident
        parser.error("--store is empty: give a store URL, or leave --store out for the default")
    listening = None
    if bind is not None:
        from effectfence.mcp import http

        # before the store: a port in use refused the command after it had made a whole
        # store file (found by review); SystemExit with one line if it cannot listen
        listening = http.listen_socket(*bind)
    store_url = args.store or default_store_url()
    try:
        config = FenceConfig(lease_ttl=args.lease_ttl, result_ttl=args.result_ttl)
        fence = open_fence(store_url, config)
        signer = TicketSigner.for_store(fence.store)
    except ValueError as exc:
        hint = f" (check {TICKET_KEY_ENV})" if "key" in str(exc) else ""
        if listening is not None:
            listening.close()
        parser.error(f"{exc}{hint}")
    except (StoreUnavailable, RuntimeError, OSError) as exc:  # one line, not a traceback
        if listening is not None:
            listening.close()
        print(f"effectfence serve: can't open the store: {exc}", file=sys.stderr)
        return 1
    configure_logging(args.log_level or ("off" if bind is None else "info"))
    metrics = Metrics()
    server = build_server(
        fence,
        allow_clear=args.allow_clear,
        signer=signer,
        metrics=metrics,
        authenticated=principals is not None,
        freeze_heap=True,
    )
    try:
        if bind is None:
            server.run("stdio")
        else:
            from effectfence.mcp import http
            from effectfence.store import redact

            console = None
            if args.console:
                console = http.console_for(
                    fence,
                    host=bind[0],
                    principals=principals,
                    allowed_hosts=args.allow_host,
                    allow_clear=args.allow_clear,
                    show_payload=args.show_payload,
                    store_label=redact(store_url),
                )
            anyio.run(
                lambda: http.serve_http(
                    server,
                    fence,
                    metrics,
                    host=bind[0],
                    port=bind[1],
                    principals=principals,
                    allowed_hosts=args.allow_host,
                    console=console,
                    sock=listening,
                )
            )
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
