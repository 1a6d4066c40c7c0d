"""``@fenced``: run a plain function once per intent; duplicates get the recorded result.

The decorator builds the request from the function's arguments and hands the rest to the
one driver (:mod:`effectfence.driver`), sync or async: prepare, wait for a holder, run,
renew, then commit (the result becomes the certificate's ``result``), abort (an exception:
the outcome is unknown, G9), or release (an exception type declared "did not fire").
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, ParamSpec, TypeVar, cast

from effectfence.driver import FencedCall, Options, run_async, run_sync
from effectfence.errors import InvalidRequest
from effectfence.fence import EffectFence
from effectfence.model import EffectRequest, PreparedEffect

__all__ = ["FencedCall", "fenced"]

P = ParamSpec("P")
R = TypeVar("R")

Template = str | Callable[..., str]


def _renderer(template: Template, what: str) -> Callable[[dict[str, Any]], str]:
    if callable(template):
        fn = template

        def call(bound: dict[str, Any]) -> str:
            value = fn(**bound)
            if type(value) is not str or not value:
                raise InvalidRequest(f"{what} callable must return a non-empty string")
            return value

        return call
    if type(template) is not str or not template:
        raise TypeError(f"{what} must be a non-empty str template or a callable")
    fmt = template.format

    def render(bound: dict[str, Any]) -> str:
        try:
            return fmt(**bound)
        except (KeyError, IndexError, AttributeError, ValueError, TypeError) as exc:
            # ValueError, TypeError: a format spec the value does not take ({order:05d}
            # given "12" or None), which escaped untyped (found by review)
            raise InvalidRequest(f"{what} template {template!r} can't be filled: {exc}") from exc

    return render


def fenced(
    fence: EffectFence,
    *,
    intent: Template,
    domain: Template,
    tool: str | None = None,
    agent: Template = "anonymous",
    args: Callable[..., Mapping[str, Any]] | None = None,
    did_not_fire: tuple[type[BaseException], ...] = (),
    wait: bool = False,
    wait_timeout: float | None = None,
    renew_every: float | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Fence a sync or async function.

    ``intent``, ``domain`` and ``agent`` are ``str.format`` templates over the function's
    bound arguments (``"charge:{order_id}"``) or callables taking them as keywords. ``args``
    (default: the bound arguments) is the payload that makes two calls "the same action".
    With ``wait``, a duplicate that finds the intent in flight waits for the holder (woken
    by the fence, not polling) up to ``wait_timeout`` seconds, which must be shorter than
    the lease, then returns the holder's result or raises its refusal. ``renew_every``
    renews the lease in the background while a long function runs.
    """
    if args is not None and not callable(args):
        # names (as wrap's intent_args takes) were accepted here and failed at the first
        # call with "'tuple' object is not callable" (found by review)
        raise TypeError(
            f"args must be a callable taking the bound arguments as keywords and returning "
            f"the payload, e.g. args=lambda self, order_id: {{'order_id': order_id}}; got "
            f"{type(args).__name__}"
        )
    lease = fence.config.lease_ttl
    if wait_timeout is None:
        wait_timeout = lease / 2
    if not 0 < wait_timeout < lease:
        raise ValueError(f"wait_timeout must be > 0 and shorter than the lease ({lease}s)")
    if renew_every is not None and not 0 < renew_every < lease:
        raise ValueError(f"renew_every must be > 0 and shorter than the lease ({lease}s)")
    if not isinstance(did_not_fire, tuple) or not all(
        isinstance(t, type) and issubclass(t, BaseException) for t in did_not_fire
    ):
        raise TypeError("did_not_fire must be a tuple of exception types")
    render_intent = _renderer(intent, "intent")
    render_domain = _renderer(domain, "domain")
    render_agent = _renderer(agent, "agent")
    options = Options(
        wait=wait,
        wait_timeout=float(wait_timeout),
        renew_every=renew_every,
        did_not_fire=did_not_fire,
    )
    offload = fence.store.shared  # a store doing I/O must not block the event loop

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            # its body runs only when iterated, after the fence has recorded the call
            raise TypeError(
                f"can't fence the generator function {fn.__name__}: its body would run "
                "after the fence recorded the call; fence a function that does the effect "
                "and returns its result"
            )
        sig = inspect.signature(fn)
        qualname = getattr(fn, "__qualname__", type(fn).__qualname__)  # or a callable object
        tool_name = tool or f"{fn.__module__}.{qualname}"
        bind = _binder(sig, tool_name)

        def build(a: tuple[Any, ...], kw: dict[str, Any]) -> EffectRequest:
            bound = bind(a, kw)
            payload = dict(args(**bound)) if args is not None else dict(bound)
            return EffectRequest(
                render_intent(bound),
                render_domain(bound),
                tool_name,
                payload,
                render_agent(bound),
            )

        if _is_async(fn):
            afn = cast(Callable[..., Any], fn)

            async def acall(*a: Any, **kw: Any) -> FencedCall:
                async def effect(ticket: PreparedEffect) -> Any:
                    return await afn(*a, **kw)

                return await run_async(fence, build(a, kw), options, effect, offload=offload)

            @functools.wraps(fn)
            async def awrapper(*a: Any, **kw: Any) -> Any:
                return (await acall(*a, **kw)).result

            awrapper.call_with_cert = acall  # type: ignore[attr-defined]
            return cast(Callable[P, R], awrapper)

        def effect(a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
            out = fn(*a, **kw)
            if inspect.iscoroutine(out):  # a sync wrapper the async check could not see
                out.close()
                # fenced as failed, not released: the wrapper's own body ran and may have
                # done something before handing the coroutine back (found by review)
                raise TypeError(
                    f"{tool_name} returned a coroutine without running it: fence the async "
                    "function itself, not a sync wrapper of it; the coroutine was not run, "
                    "and the intent is fenced until an operator clears it"
                )
            return out

        def call(*a: Any, **kw: Any) -> FencedCall:
            return run_sync(fence, build(a, kw), options, lambda ticket: effect(a, kw))

        @functools.wraps(fn)
        def wrapper(*a: Any, **kw: Any) -> Any:
            return call(*a, **kw).result

        wrapper.call_with_cert = call  # type: ignore[attr-defined]
        return cast(Callable[P, R], wrapper)

    return decorate


def _is_async(fn: Callable[..., Any]) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one: taken for a plain
    function, its call returns an un-run coroutine that the fence can't record. A sync
    function stays sync, even one wrapping an async function (a bridge that runs it with
    asyncio.run is called without await); one that hands a coroutine back is caught when
    it does."""
    call = type(fn).__call__ if not inspect.isfunction(fn) else None
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def _binder(
    sig: inspect.Signature, tool_name: str
) -> Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any]]:
    """Arguments -> {name: value} with defaults applied.

    ``Signature.bind`` costs more than the rest of a fenced call's bookkeeping, so plain
    signatures (named parameters, no ``*args``/``**kwargs``/positional-only) get a direct
    binder; anything else falls back to ``inspect``. Errors are the caller's: typed.
    """
    params = list(sig.parameters.values())
    kinds = {p.kind for p in params}
    if not kinds <= {inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY}:

        def slow(a: tuple[Any, ...], kw: dict[str, Any]) -> dict[str, Any]:
            try:
                b = sig.bind(*a, **kw)
            except TypeError as exc:
                raise InvalidRequest(f"{tool_name}: {exc}") from exc
            b.apply_defaults()
            return dict(b.arguments)

        return slow

    positional = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    names = frozenset(p.name for p in params)
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    required = [p.name for p in params if p.default is inspect.Parameter.empty]
    npos = len(positional)

    def fast(a: tuple[Any, ...], kw: dict[str, Any]) -> dict[str, Any]:
        if len(a) > npos:
            raise InvalidRequest(f"{tool_name}: takes {npos} positional arguments, got {len(a)}")
        bound = dict(zip(positional, a, strict=False))
        for k, v in kw.items():
            if k in bound or k not in names:
                raise InvalidRequest(f"{tool_name}: unexpected or repeated argument {k!r}")
            bound[k] = v
        if len(bound) != len(names):
            for k in required:
                if k not in bound:
                    raise InvalidRequest(f"{tool_name}: missing argument {k!r}")
            for k, v in defaults.items():
                bound.setdefault(k, v)
        return bound

    return fast
