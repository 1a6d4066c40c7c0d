"""The C accelerator (effectfence._speedups): canonical bytes identical to the reference
encoder, and fast paths that agree with the Python paths they shadow, operation by operation.

The guarantee suites (test_fence, test_chaos, test_stateful, ...) already run on the fast
path through their ``memory-atomic`` store; this file proves the accelerator's own claims:
it declines exactly what it cannot do exactly, its fallbacks change nothing, its re-checks
under the stripe lock hold when another writer gets in first, and nothing it builds leaks.
"""

from __future__ import annotations

import gc
import json
import os
import struct
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from hypothesis import given, settings
from hypothesis import strategies as st
from support import FakeClock, race

from effectfence import (
    EffectFence,
    EffectRequest,
    FenceConfig,
    Fresh,
    IntentInFlight,
    InvalidRequest,
    LeaseLost,
    Refusal,
    Replay,
    _accel,
)
from effectfence.canonical import CanonicalError, _es6_number, _exact_bytes, canonical_bytes
from effectfence.clock import VectorClock
from effectfence.counters import backend_info
from effectfence.protocol import State
from effectfence.store.memory import MemoryStore

sp = _accel.speedups
needs_c = pytest.mark.skipif(sp is None, reason=f"accelerator off: {_accel.import_error}")
VECTORS = Path(__file__).parent / "vectors" / "jcs"


def test_accelerator_presence_follows_the_backend() -> None:
    """CI's atomic run must exercise the C paths; its pure run must not touch them."""
    forced = os.environ.get("EFFECTFENCE_COUNTERS", "").strip().lower()
    fence = EffectFence()
    if forced == "atomic":
        assert sp is not None and fence._fast is not None
    if forced == "pure":
        assert sp is None and fence._fast is None
    assert backend_info()["speedups"] is (sp is not None)
    assert (fence._fast is not None) is (
        sp is not None and fence.store.counters_backend == "atomic"
    )


# ------------------------------------------------------------------------- canonical JSON

_keys = st.text(max_size=6)
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats()
    | st.text(max_size=8)
)
_json = st.recursive(
    _scalars,
    lambda c: st.lists(c, max_size=4) | st.tuples(c, c) | st.dictionaries(_keys, c, max_size=5),
    max_leaves=24,
)


def _reference(value: object, depth: int = 64) -> bytes | None:
    try:
        return _exact_bytes(value, depth)
    except CanonicalError:
        return None


@needs_c
@settings(max_examples=600)
@given(_json)
def test_c_encoder_equals_the_reference_or_declines_what_it_refuses(value: Any) -> None:
    got = sp.canonical(value, 64)
    assert got == _reference(value)
    if got is not None and not isinstance(value, tuple):
        assert got == rfc8785.dumps(value)


@needs_c
@settings(max_examples=400)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_c_encoder_writes_every_double_the_es6_way(x: float) -> None:
    assert sp.canonical(x, 1) == _es6_number(x).encode()
    assert sp.canonical([x], 2) == b"[" + _es6_number(x).encode() + b"]"


@needs_c
def test_c_encoder_on_the_published_number_table() -> None:
    rows = 0
    for line in (VECTORS / "numbers.txt").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        bits, text = line.split()
        x = struct.unpack(">d", bytes.fromhex(bits.zfill(16)))[0]
        assert sp.canonical(x, 1) == (
            None if x != x or x in (float("inf"), -float("inf")) else text.encode()
        )
        rows += 1
    assert rows > 20


@needs_c
@pytest.mark.parametrize("name", sorted(p.stem for p in (VECTORS / "input").glob("*.json")))
def test_c_encoder_on_the_published_vectors(name: str) -> None:
    value = json.loads((VECTORS / "input" / f"{name}.json").read_bytes())
    assert sp.canonical(value, 64) == (VECTORS / "output" / f"{name}.json").read_bytes()


def _objects(lowest: int, longest_key: int, min_size: int, max_size: int) -> Any:
    """JSON objects of small ints whose keys run from ``lowest`` into the astral planes."""
    chars = st.characters(min_codepoint=lowest, max_codepoint=0x1F6FF, exclude_categories=["Cs"])
    return st.dictionaries(
        st.text(chars, max_size=longest_key),
        st.integers(0, 9),
        min_size=min_size,
        max_size=max_size,
    )


@needs_c
@settings(max_examples=300)
@given(_objects(0xD7F0, 3, 0, 6))
def test_c_encoder_orders_keys_by_utf16_code_units(value: dict[str, int]) -> None:
    """Keys mixing U+E000..U+FFFF with astral characters: code-point order is wrong here."""
    assert sp.canonical(value, 2) == _reference(value) == rfc8785.dumps(value)


@needs_c
@settings(max_examples=150)
@given(_objects(0x20, 4, 9, 40))
def test_c_encoder_sorts_large_objects_too(value: dict[str, int]) -> None:
    """Up to 8 members are insertion-sorted, more go through qsort: both orders are exact."""
    assert sp.canonical(value, 2) == _reference(value) == rfc8785.dumps(value)


class _Str(str):
    pass


class _Dict(dict):  # type: ignore[type-arg]
    pass


class _Int(int):
    pass


_cycle: list[Any] = []
_cycle.append(_cycle)


@needs_c
@pytest.mark.parametrize(
    "value",
    [
        float("nan"),
        float("inf"),
        2**53,
        -(2**53),
        2**70,
        "\ud800",
        {"\udfff": 1},
        {1: 2},
        {"a": b"bytes"},
        {"a": {1, 2}},
        _Str("x"),
        _Dict(a=1),
        {"a": _Int(1)},
        object(),
        [[[[1]]]],
        _cycle,
    ],
    ids=repr,
)
def test_c_encoder_declines_and_the_reference_names_the_problem(value: Any) -> None:
    assert sp.canonical(value, 3) is None
    subclassed = isinstance(value, (_Str, _Dict)) or value == {"a": 1}
    if subclassed:  # JSON after all: the Python path encodes it (as its plain base type)
        assert canonical_bytes(value, max_depth=3) == _exact_bytes(value, 3)
    else:
        with pytest.raises(CanonicalError):
            canonical_bytes(value, max_depth=3)


@needs_c
def test_c_encoder_caps_depth_without_recursing_into_a_cycle() -> None:
    assert sp.canonical(_cycle, 10**9) is None
    deep: Any = 1
    for _ in range(600):
        deep = [deep]
    assert sp.canonical(deep, 10**9) is None  # beyond the C cap: the Python encoder decides
    assert sp.canonical(deep, 601) is None
    assert sp.canonical([[1]], 2) == b"[[1]]"


@needs_c
@settings(max_examples=300)
@given(st.text())
def test_c_string_is_the_reference(text: str) -> None:
    assert sp.string(text) == _exact_bytes(text)


@needs_c
def test_c_string_declines_lone_surrogates_and_subclasses() -> None:
    assert sp.string("a\ud800b") is None
    assert sp.string(_Str("x")) is None
    assert sp.string('\x00"\\\x1f\x7f\u2028') == b'"\\u0000\\"\\\\\\u001f\x7f\xe2\x80\xa8"'


# ------------------------------------------------------------------------------ fast path


class PythonPathFence(EffectFence):
    """Overrides prepare and commit, so the accelerator stays out: the Python twin."""

    def prepare(self, request: EffectRequest) -> Any:
        return super().prepare(request)

    def commit(self, ticket: Any, result: Any) -> Any:
        return super().commit(ticket, result)


def _pair(**cfg: Any) -> tuple[EffectFence, FakeClock, EffectFence, FakeClock]:
    cfg.setdefault("auto_sweep", False)
    c1, c2 = FakeClock(), FakeClock()
    fast = EffectFence(FenceConfig(clock=c1, lease_ttl=10.0, result_ttl=50.0, **cfg))
    slow = PythonPathFence(FenceConfig(clock=c2, lease_ttl=10.0, result_ttl=50.0, **cfg))
    assert fast._fast is not None and slow._fast is None
    return fast, c1, slow, c2


_INTENTS = ["i0", "i1", "i2"]
_op = st.one_of(
    st.tuples(
        st.just("prepare"),
        st.sampled_from(_INTENTS),
        st.sampled_from(["d0", "d1"]),
        st.sampled_from([{"a": 1}, {"a": 2.5}, {"b": ["x", None]}]),
        st.sampled_from(["ag0", "ag1"]),
        st.sampled_from(["plain", "parent", "known", "expected", "stale", "read_set"]),
    ),
    st.tuples(st.just("commit"), st.sampled_from(_INTENTS), st.sampled_from([{"r": 1}, [1.5]])),
    st.tuples(st.just("commit_old"), st.sampled_from(_INTENTS)),
    st.tuples(st.just("abort"), st.sampled_from(_INTENTS)),
    st.tuples(st.just("release"), st.sampled_from(_INTENTS)),
    st.tuples(st.just("advance"), st.sampled_from([1.0, 9.999, 10.0, 30.0, 60.0])),
    st.tuples(st.just("sweep")),
    st.tuples(st.just("clear"), st.sampled_from(_INTENTS)),
)


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        out = fn()
    except Refusal as exc:
        return ("refused", exc.code, exc.details.get("state"))
    if isinstance(out, Fresh):
        t = out.ticket
        return ("fresh", out.takeover, t.seq, t.parent, t.vector_clock.to_dict(), t.lease_until)
    if isinstance(out, Replay):
        return ("replay", tuple(out.cert))
    if isinstance(out, tuple):  # a certificate: every field, the hash included
        return ("cert", tuple(out))
    return ("value", out)


class _Twin:
    def __init__(self, fence: EffectFence, clock: FakeClock) -> None:
        self.fence, self.clock = fence, clock
        self.tickets: dict[str, list[Any]] = {}

    def run(self, op: tuple[Any, ...]) -> Any:
        f, kind = self.fence, op[0]
        if kind == "prepare":
            _, intent, domain, args, agent, extra = op
            kw: dict[str, Any] = {}
            if extra == "parent":
                kw["parent"] = "p" * 64
            elif extra == "known":
                kw["known_clock"] = {"ag0": 3, "zz": 1}
            elif extra == "expected":
                kw["expected_seq"] = f.current(domain)
            elif extra == "stale":  # a view the domain has moved past (or not reached)
                kw["expected_seq"] = abs(f.current(domain) - 1)
            elif extra == "read_set":
                kw["read_set"] = [("d0", f.current("d0"))]

            def prep() -> Any:
                adm = f.prepare(EffectRequest(intent, domain, "t", args, agent, **kw))
                if adm.fresh:
                    self.tickets.setdefault(intent, []).append(adm.ticket)
                return adm

            return _outcome(prep)
        if kind in ("commit", "commit_old", "abort", "release"):
            held = self.tickets.get(op[1])
            if not held:
                return None
            ticket = held[0] if kind == "commit_old" else held[-1]
            if kind in ("commit", "commit_old"):
                return _outcome(lambda: f.commit(ticket, op[2] if kind == "commit" else {}))
            if kind == "abort":
                return _outcome(lambda: f.abort(ticket))
            return _outcome(lambda: f.release(ticket))
        if kind == "advance":
            self.clock.advance(op[1])
            return None
        if kind == "sweep":
            return f.sweep()
        return _outcome(lambda: f.clear_intent(op[1]))


@needs_c
@settings(max_examples=250, deadline=None)
@given(st.lists(_op, max_size=40))
def test_fast_path_agrees_with_the_python_path_step_by_step(ops: list[tuple[Any, ...]]) -> None:
    """Same operations, same clock: the same admissions, seqs, clocks, parents, refusals and
    certificates (byte for byte), and the same statistics."""
    fast, c1, slow, c2 = _pair()
    a, b = _Twin(fast, c1), _Twin(slow, c2)
    for op in ops:
        assert a.run(op) == b.run(op), op
    assert fast.stats() == slow.stats()
    for d in ("d0", "d1"):
        assert fast.current(d) == slow.current(d)
        assert fast.store.in_flight(d) == slow.store.in_flight(d)
    for i in _INTENTS:
        assert fast.intent_status(i).state == slow.intent_status(i).state


@needs_c
def test_fast_path_is_installed_only_where_it_applies() -> None:
    assert EffectFence()._fast is not None
    assert EffectFence(FenceConfig(counters="pure"))._fast is None

    class OtherStore(MemoryStore):
        pass

    assert EffectFence(store=OtherStore())._fast is None
    assert PythonPathFence()._fast is None


def _duplicates(fence: EffectFence, intent: str, n: int, agent: str = "") -> list[Any]:
    return race(
        n, lambda i: fence.prepare(EffectRequest(intent, "d", "t", {"a": 1}, agent or f"a{i}"))
    )


@needs_c
def test_fast_path_concurrent_duplicates_admit_exactly_one() -> None:
    for trial in range(20):
        fence = EffectFence(FenceConfig(auto_sweep=False))
        out = _duplicates(fence, f"x{trial}", 16)
        fresh = [r for r in out if isinstance(r, Fresh)]
        assert len(fresh) == 1
        assert all(isinstance(r, IntentInFlight) for r in out if r is not fresh[0])
        cert = fence.commit(fresh[0].ticket, {"ok": True})
        again = _duplicates(fence, f"x{trial}", 8, agent="b")
        assert all(isinstance(r, Replay) and r.cert.hash == cert.hash for r in again)
        assert fence.stats()["prepare"]["admitted"] == 1


class _HookLock:
    """A stripe lock that runs ``hook`` once, just before its first acquire: the window
    between the fast path's unlocked read and its locked write, held open on purpose."""

    def __init__(self, hook: list[Callable[[], None]]) -> None:
        self._lock = threading.Lock()
        self._hook = hook

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._hook:
            self._hook.pop()()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _in_thread(fn: Callable[[], Any]) -> Any:
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(_outcome(fn)))
    t.start()
    t.join()
    return box[0]


@needs_c
def test_claim_rechecks_under_the_lock_when_another_claim_gets_in_first() -> None:
    fence = EffectFence(FenceConfig(auto_sweep=False))
    req = EffectRequest("race", "d", "t", {"a": 1}, "agent-a")
    other: list[Any] = []
    hook = [lambda: other.append(_in_thread(lambda: fence.prepare(req)))]
    store = fence.store
    assert isinstance(store, MemoryStore)
    store._locks[:] = [_HookLock(hook) for _ in store._locks]
    with pytest.raises(IntentInFlight):
        fence.prepare(req)  # read "absent", then lost the stripe to the other claim
    assert other[0][0] == "fresh"
    assert fence.stats()["prepare"]["admitted"] == 1
    assert store.in_flight("d") == 1 and fence.current("d") == 1


@needs_c
def test_commit_rechecks_under_the_lock_when_the_lease_moves_first() -> None:
    fence = EffectFence(FenceConfig(auto_sweep=False))
    ticket = fence.prepare(EffectRequest("moved", "d", "t", {"a": 1}, "agent-a")).ticket
    hook = [lambda: _in_thread(lambda: fence.abort(ticket, "operator"))]
    store = fence.store
    assert isinstance(store, MemoryStore)
    store._locks[:] = [_HookLock(hook) for _ in store._locks]
    with pytest.raises(LeaseLost):
        fence.commit(ticket, {"charged": True})  # judged current, then aborted under it
    status = fence.intent_status("moved")
    assert status.state == "failed" and fence.stats()["commits"] == 0
    assert store.in_flight("d") == 0


@needs_c
def test_fast_path_fallbacks_leave_no_trace() -> None:
    fence = EffectFence(FenceConfig(auto_sweep=False, max_args_bytes=32, max_result_bytes=16))
    with pytest.raises(InvalidRequest, match="over max_args_bytes"):
        fence.prepare(EffectRequest("big", "d", "t", {"a": "x" * 64}))
    with pytest.raises(InvalidRequest):
        fence.prepare(EffectRequest("nan", "d", "t", {"a": float("nan")}))
    ticket = fence.prepare(EffectRequest("ok", "d", "t", {"a": 1})).ticket
    with pytest.raises(InvalidRequest, match="result"):
        fence.commit(ticket, {"r": "y" * 64})
    with pytest.raises(InvalidRequest, match="result"):
        fence.commit(ticket, {"r": float("inf")})
    assert fence.intent_status("ok").state == "in_flight"  # still committable
    assert fence.commit(ticket, {"r": 1}).verify()
    s = fence.stats()
    assert s["prepare"]["invalid_request"] == 2 and s["prepare"]["admitted"] == 1
    assert s["size"]["records"] == 1 and fence.current("d") == 1


@needs_c
def test_records_and_certificates_stay_out_of_the_cycle_collector() -> None:
    fence = EffectFence(FenceConfig(auto_sweep=False))
    adm = fence.prepare(EffectRequest("gc", "d", "t", {"a": [1, {"b": 2}]}))
    cert = fence.commit(adm.ticket, {"r": [1, 2]})
    rec = fence.store.get("gc")
    assert rec is not None and rec.state is State.DONE
    assert not gc.is_tracked(rec) and not gc.is_tracked(cert)
    assert not gc.is_tracked(adm.ticket.vector_clock)
    assert cert.verify() and cert.args == {"a": [1, {"b": 2}]}
    # the fence itself (it and its fast path refer to each other) is still collected
    ref = weakref.ref(fence)
    del fence, adm, rec
    gc.collect()
    assert ref() is None


# ---------------------------------------------------------------------- EffectRequest init

_names = st.one_of(
    st.text(max_size=6),
    st.sampled_from(["", "x" * 512, "x" * 513, "caf\u00e9", "a\ud800", "\U0001f600"]),
    st.sampled_from([None, 5, b"bytes"]),
)
_req_args = st.sampled_from([None, {}, {"a": 1}, [("a", 1)], "text", 7])


def _built(init: Callable[..., None], call: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    obj = EffectRequest.__new__(EffectRequest)
    try:
        init(obj, *call, **kw)
    except InvalidRequest as exc:
        return ("refused", str(exc))
    return ("built", *(getattr(obj, f) for f in EffectRequest.__slots__))


@needs_c
@settings(max_examples=500)
@given(
    st.tuples(_names, _names, _names),
    st.lists(st.one_of(_req_args, _names), max_size=2),
    st.sampled_from([{}, {"expected_seq": 3}, {"parent": "p"}]),
)
def test_request_init_in_c_builds_or_refuses_exactly_as_the_python_init(
    names: tuple[Any, ...], rest: list[Any], kw: dict[str, Any]
) -> None:
    call = (*names, *rest)
    fast = EffectRequest.__init__
    assert type(fast) is sp.RequestInit
    assert _built(fast, call, kw) == _built(fast.__wrapped__, call, kw)


@needs_c
@pytest.mark.parametrize(
    "call",
    [("", "d", "t"), ("i", "d", "x" * 513), ("i", "d", "t", {}, ""), ("i", "d", "t", [1])],
)
def test_request_init_in_c_refuses_what_python_refuses(call: tuple[Any, ...]) -> None:
    with pytest.raises(InvalidRequest):
        EffectRequest(*call)
    req = EffectRequest("i", "d", "t")
    assert (req.args, req.agent, req.read_set, req.parent) == ({}, "anonymous", (), None)


@needs_c
@pytest.mark.parametrize("route", ["openssl", "hashlib"])
def test_certificate_hash_is_the_same_through_either_sha256_route(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C path hashes with OpenSSL's SHA256() directly when it can find the libcrypto
    hashlib loaded (self-checked), else through hashlib: both give the Python path's hash."""
    if route == "hashlib":
        monkeypatch.setattr(_accel, "openssl_sha256_address", lambda: 0)
    elif not _accel.openssl_sha256_address():
        pytest.skip("no OpenSSL SHA256() in this process (not Linux, or hashlib without it)")
    fast, _, slow, _ = _pair()
    for i, args in enumerate([{"a": 1}, {"b": [1.5, "\u00e9", None]}, {}]):
        certs = []
        for fence in (fast, slow):
            adm = fence.prepare(EffectRequest(f"h{i}", "d", "t", args, "agent"))
            certs.append(fence.commit(adm.ticket, {"n": i, "s": "x" * i * 100}))
        assert tuple(certs[0]) == tuple(certs[1]) and certs[0].verify()


class _Hostile:
    """A clock value that empties the dict being merged as soon as it is compared."""

    def __init__(self, victim: dict[str, Any]) -> None:
        self.victim = victim

    def __gt__(self, other: object) -> bool:
        self.victim.clear()
        return True


def _private_clocks() -> list[dict[str, Any]]:
    hostile: dict[str, Any] = {}
    hostile["ag"] = _Hostile(hostile)
    return [
        hostile,
        {"ag": 2**70},
        {"zz": "x", "ag": 1},
        {"ag": -1},
        {"ag": True},
        {"ag": 0},
        {"z": 0, "ag": 2},
    ]


@needs_c
@pytest.mark.parametrize("i", range(7))
def test_known_clocks_forged_through_private_state_take_the_python_path(i: int) -> None:
    """Found by a valgrind run: a clock built with VectorClock._trusted (bypassing its checks)
    whose value ran Python code mid-merge made the C merge read freed memory. The C path now
    merges only a snapshot of exact str -> int in range taken before the claim, and hands any
    other clock to the Python path: the same outcome, no memory error."""
    outcomes = []
    for fence in _pair()[::2]:
        first = fence.prepare(EffectRequest("i0", "d", "t", {}, "ag"))
        fence.commit(first.ticket, 1)  # the domain head's clock is {"ag": 1}
        req = EffectRequest("i1", "d", "t", {}, "ag")
        req.known_clock = VectorClock._trusted(_private_clocks()[i])
        try:
            adm = fence.prepare(req)
            outcomes.append(("fresh", adm.ticket.vector_clock.to_dict(), adm.ticket.seq))
        except Exception as exc:  # whatever Python does with it, the C path must do too
            outcomes.append(("raised", type(exc).__name__))
        outcomes.append(fence.stats()["prepare"])
    assert outcomes[:2] == outcomes[2:]


# -------------------------------------------------- defects found by review, kept fixed


@needs_c
def test_a_failing_openssl_sha256_falls_back_to_hashlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """OpenSSL's SHA256() returns NULL and leaves the output alone when it cannot hash (no
    memory, no provider): the C path must not hex-encode stack bytes into a certificate."""
    import ctypes

    calls = []

    @ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    def failing_sha256(data: int, n: int, out: int) -> None:
        calls.append(n)
        return None

    address = ctypes.cast(failing_sha256, ctypes.c_void_p).value
    monkeypatch.setattr(_accel, "openssl_sha256_address", lambda: address)
    fence = EffectFence(FenceConfig(auto_sweep=False))
    adm = fence.prepare(EffectRequest("sha", "d", "t", {"a": 1}))
    cert = fence.commit(adm.ticket, {"ok": True})
    assert calls and cert.verify()


@needs_c
def test_deep_input_never_recurses_deep_in_c(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by review: ~320 bytes of C stack per nesting level up to 512 levels overflowed
    a 128 KiB thread stack. Deeper than 128 levels now goes to the Python encoder."""
    deep: Any = 1
    for _ in range(128):
        deep = [deep]
    assert sp.canonical(deep, 10**9) == b"[" * 128 + b"1" + b"]" * 128
    assert sp.canonical([deep], 10**9) is None
    nested: Any = {"v": 1}
    for _ in range(400):
        nested = {"k": nested}
    fence = EffectFence(FenceConfig(auto_sweep=False, max_depth=512))
    out: list[Any] = []
    old = threading.stack_size(128 * 1024)
    try:
        t = threading.Thread(
            target=lambda: out.append(fence.prepare(EffectRequest("deep", "d", "t", nested)))
        )
        t.start()
        t.join()
    finally:
        threading.stack_size(old)
    assert out and out[0].fresh


@needs_c
def test_config_values_beyond_c_types_keep_working() -> None:
    """Found by review: limits C cannot hold broke fences only when the accelerator loaded."""
    big = EffectFence(FenceConfig(auto_sweep=False, max_args_bytes=10**30, max_result_bytes=10**30))
    assert big._fast is not None
    assert big.commit(big.prepare(EffectRequest("i", "d", "t", {"a": 1})).ticket, 1).verify()
    inf = EffectFence(FenceConfig(auto_sweep=False, max_depth=float("inf")))  # type: ignore[arg-type]
    assert inf._fast is None
    assert inf.commit(inf.prepare(EffectRequest("i", "d", "t", {"a": [1]})).ticket, 1).verify()
    assert canonical_bytes({"a": [1]}, max_depth=float("inf")) == b'{"a":[1]}'  # type: ignore[arg-type]


@needs_c
def test_overriding_any_method_the_c_path_stands_in_for_keeps_the_python_paths() -> None:
    """Found by review: a subclass's _result_json hook ran only on the rows C handed back."""

    class NoCardNumbers(EffectFence):
        def _result_json(self, intent: str, result: Any) -> bytes:
            if isinstance(result, dict) and "pan" in result:
                raise InvalidRequest("results must not carry card numbers")
            return super()._result_json(intent, result)

    fence = NoCardNumbers(FenceConfig(auto_sweep=False))
    assert fence._fast is None
    ticket = fence.prepare(EffectRequest("card", "d", "t", {})).ticket
    with pytest.raises(InvalidRequest, match="card numbers"):
        fence.commit(ticket, {"pan": "4111111111111111"})


@needs_c
def test_a_second_init_does_not_keep_the_old_fast_path() -> None:
    fence = EffectFence(FenceConfig(auto_sweep=False))
    assert fence._fast is not None
    EffectFence.__init__(fence, FenceConfig(auto_sweep=False, counters="pure"))
    assert fence._fast is None and "prepare" not in fence.__dict__
    fence.prepare(EffectRequest("again", "d", "t", {}))
    assert fence.intent_status("again").state == "in_flight"
    assert fence.stats()["prepare"]["admitted"] == 1


@needs_c
def test_expected_seq_on_a_counted_domain_admits_one_view_and_refuses_the_rest() -> None:
    """Strict OCC on the C path: compare-and-advance under the stripe lock; a stale view is
    refused domain_race and moves nothing; a commit whose domain moved fails the intent."""
    fast, _, slow, _ = _pair()
    rows = []
    for fence in (fast, slow):
        seed = fence.prepare(EffectRequest("seed", "acct", "t", {}))
        fence.commit(seed.ticket, 1)  # the domain is counted, at 1
        row = [
            _outcome(
                lambda f=fence, i=i, e=e: f.prepare(
                    EffectRequest(f"e{i}", "acct", "t", {}, "ag", expected_seq=e)
                )
            )
            for i, e in enumerate([0, 2, 1, 1])
        ]
        ticket = fence.store.get("e2")
        row.append(fence.current("acct"))
        late = fence.prepare(EffectRequest("late", "acct", "t", {}, "ag", expected_seq=2))
        fence.commit(fence.prepare(EffectRequest("mover", "acct", "t", {})).ticket, 2)
        row.append(_outcome(lambda f=fence, t=late.ticket: f.commit(t, 3)))
        row.append(fence.intent_status("late").state)
        row.append(fence.stats())
        rows.append(row)
        assert ticket is not None
    assert rows[0] == rows[1]
    got = rows[0]
    assert [o[0] for o in got[:4]] == ["refused", "refused", "fresh", "refused"]
    assert got[0][1] == got[1][1] == got[3][1] == "domain_race" and got[2][2] == 2
    assert got[4] == 2 and got[5][1] == "read_set_stale" and got[6] == "failed"


@needs_c
@pytest.mark.parametrize("meddle", ["clear", "none", "int"])
def test_a_meddled_sweep_deadline_goes_to_the_python_path(meddle: str) -> None:
    """Found by review: the C path read the one-slot deadline list without a bounds check,
    so emptying it (private state) crashed the process. Anything but one float now goes to
    the Python path, which behaves as it always did."""
    outcomes = []
    for fence in _pair(auto_sweep=True)[::2]:
        fence.prepare(EffectRequest("warm", "d", "t", {}))  # the first prepare sweeps
        due = fence._sweep_due
        if meddle == "clear":
            due.clear()
        else:
            due[0] = None if meddle == "none" else 10**6
        try:
            outcomes.append(_outcome(lambda f=fence: f.prepare(EffectRequest("x", "d", "t", {}))))
        except Exception as exc:  # whatever Python does with it, the C path must do too
            outcomes.append(("raised", type(exc).__name__))
    assert outcomes[0] == outcomes[1]
