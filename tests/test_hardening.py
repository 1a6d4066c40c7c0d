"""Regressions for issue #10 (an adversarial soak of the public API), items 2-7.

Each test names its item. Every one runs in both builds: CI runs this file compiled
(EFFECTFENCE_COUNTERS=atomic) and pure (EFFECTFENCE_COUNTERS=pure, the C speedups off too).
"""

from __future__ import annotations

import copy
import gc
import itertools
import math
import pickle
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import preemptive

from effectfence import (
    EffectCert,
    EffectFence,
    EffectRequest,
    FenceConfig,
    InvalidRequest,
    ReadSetStale,
    Refusal,
    VectorClock,
    canonical,
    verify_chain,
)
from effectfence.canonical import CanonicalError, canonical_bytes, fast_bytes
from effectfence.cert import MAX_PAYLOAD_DEPTH
from effectfence.model import PreparedEffect


def make_fence(**config: Any) -> EffectFence:
    config.setdefault("auto_sweep", False)
    return EffectFence(FenceConfig(**config))


def ticket_of(fence: EffectFence, request: EffectRequest) -> PreparedEffect:
    admission = fence.prepare(request)
    assert admission.fresh
    return admission.ticket


def nested_pairs(levels: int) -> list[Any]:
    """``v = [v, v]``, ``levels`` times: 2**levels leaves, a few hundred bytes of objects."""
    v: list[Any] = []
    for _ in range(levels):
        v = [v, v]
    return v


def _tuple_pairs(levels: int, leaf: Any) -> Any:
    v = leaf
    for _ in range(levels):
        v = (v, v)
    return v


def deep_list(levels: int) -> list[Any]:
    v: list[Any] = []
    for _ in range(levels):
        v = [v]
    return v


class Bounded:
    """Wall time and traced peak memory of one call."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.peak = 0

    def run(self, fn: Callable[[], object]) -> BaseException | None:
        tracemalloc.start()
        start = time.perf_counter()
        try:
            fn()
        except Exception as exc:
            return exc
        finally:
            self.seconds = time.perf_counter() - start
            self.peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        return None


# -- item 2: a kept small result costs the same in both builds -----------------------------------


def test_item2_kept_small_results_do_not_keep_orjson_buffers() -> None:
    """orjson hands out bytes with ~4 KiB of capacity however short the JSON: the pure twin
    kept two per certificate (~9 KiB per small result, against ~1 KiB compiled)."""
    fence = make_fence(result_ttl=1e9)

    def commit(i: int) -> EffectCert:
        return fence.commit(ticket_of(fence, EffectRequest(f"m{i}", "d", "t", {"n": i})), {"ok": 1})

    for i in range(200):  # warm-up: caches, interned names, table growth
        commit(-1 - i)
    gc.collect()
    n = 2000
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = [commit(i) for i in range(n)]
        gc.collect()
        per_result = (tracemalloc.get_traced_memory()[0] - before) / n
    finally:
        tracemalloc.stop()
    assert kept[-1].verify()
    assert per_result < 2500, f"{per_result:.0f} bytes per kept small result"


@pytest.mark.parametrize("python_only", [False, True])
def test_item2_every_bytes_handed_out_is_exact_size(
    python_only: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if python_only:
        monkeypatch.setattr(canonical, "_c_canonical", None)
        monkeypatch.setattr(canonical, "_c_string", None)
    encoders: list[Callable[[], bytes | None]] = [
        lambda: canonical_bytes({"ok": True}),
        lambda: fast_bytes({"ok": True}, 8),
        lambda: canonical.string_bytes("charge:1"),
        lambda: canonical.sort_keys_bytes({"a": 1}),
    ]
    for encode in encoders:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            kept = [encode() for _ in range(200)]
            per = (tracemalloc.get_traced_memory()[0] - before) / 200
        finally:
            tracemalloc.stop()
        assert kept[0] is not None
        assert per < 200, f"{per:.0f} bytes kept per {kept[0]!r}"


# -- item 3: size limits are counted while encoding ---------------------------------------------


def test_item3_shared_sublists_are_refused_after_bounded_work() -> None:
    """``v = [v, v]`` 26 times expands to ~400 MB of JSON; prepare took seconds and 0.8 GB
    before refusing, holding the GIL throughout."""
    fence = make_fence()
    bomb = nested_pairs(26)
    bounded = Bounded()
    exc = bounded.run(lambda: fence.prepare(EffectRequest("bomb", "d", "t", {"v": bomb})))
    assert isinstance(exc, InvalidRequest), exc
    assert "max_bytes" in str(exc)
    assert bounded.seconds < 2.0 and bounded.peak < 32 << 20, (bounded.seconds, bounded.peak)
    assert fence.stats()["prepare"]["invalid_request"] == 1

    ticket = ticket_of(fence, EffectRequest("ok", "d", "t", {}))
    exc = bounded.run(lambda: fence.commit(ticket, {"v": bomb}))
    assert isinstance(exc, InvalidRequest), exc
    assert bounded.seconds < 2.0 and bounded.peak < 32 << 20, (bounded.seconds, bounded.peak)
    assert fence.commit(ticket, "fine").verify()  # the refused result changed nothing


@pytest.mark.parametrize(
    "bomb",
    [
        nested_pairs(26),
        [nested_pairs(26), 1.0],  # an integral float: the exact path (pure) takes it
        [("x" * 1000,) * 100] * 10_000,  # shared tuples of long strings (exact path)
        {"k": ["y" * 100_000] * 10_000},  # one string, referenced many times
        _tuple_pairs(26, 1.0),  # tuples and integral floats: the exact path everywhere
    ],
    ids=["pairs", "pairs-exact", "tuples", "strings", "tuple-pairs"],
)
@pytest.mark.parametrize("python_only", [False, True])
def test_item3_canonical_bytes_stops_at_max_bytes(
    bomb: Any, python_only: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if python_only:
        monkeypatch.setattr(canonical, "_c_canonical", None)
    bounded = Bounded()
    exc = bounded.run(lambda: canonical_bytes(bomb, max_depth=64, max_bytes=1 << 20))
    assert isinstance(exc, CanonicalError) and exc.path == "$", exc
    assert bounded.seconds < 2.0 and bounded.peak < 32 << 20, (bounded.seconds, bounded.peak)
    exc = bounded.run(lambda: fast_bytes(bomb, 64, max_bytes=1 << 20))
    assert exc is None or isinstance(exc, CanonicalError), exc
    assert bounded.seconds < 2.0 and bounded.peak < 32 << 20, (bounded.seconds, bounded.peak)


@pytest.mark.parametrize("python_only", [False, True])
def test_item3_the_limit_is_exact(python_only: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if python_only:
        monkeypatch.setattr(canonical, "_c_canonical", None)
    for value in ({"a": "x" * 3000}, [1.5] * 700, {"é": "€" * 500}, ("t", [1.0] * 400)):
        size = len(canonical_bytes(value))
        assert canonical_bytes(value, max_bytes=size) == canonical_bytes(value)
        with pytest.raises(CanonicalError, match="max_bytes"):
            canonical_bytes(value, max_bytes=size - 1)
        fast = fast_bytes(value, 8, max_bytes=size)
        assert fast is None or fast == canonical_bytes(value)
        if fast is not None:
            with pytest.raises(CanonicalError, match="max_bytes"):
                fast_bytes(value, 8, max_bytes=size - 1)


@pytest.mark.parametrize("python_only", [False, True])
def test_item3_a_shared_container_is_held_to_max_depth_wherever_it_occurs(
    python_only: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Work on shared containers is done once; the depth limit still holds at each place."""
    if python_only:
        monkeypatch.setattr(canonical, "_c_canonical", None)
    for leaf in ([1], (1.0,)):  # the fast path's walk, the exact path's
        shared = [[[leaf]]]
        assert canonical_bytes([shared, [shared]], max_depth=6)
        with pytest.raises(CanonicalError, match="deeper than max_depth") as info:
            canonical_bytes([shared, [[shared]]], max_depth=6)
        assert info.value.path.startswith("[1][0][0]")


# -- item 4: args changed by another thread while prepare reads them ----------------------------


class _MutateDuringEncode:
    """Stands in for orjson and changes the caller's args between the shape check and the
    encoding: the widest window another thread ever had."""

    def __init__(self, real: Any, mutate: Callable[[], None]) -> None:
        self._real = real
        self._mutate = mutate
        self.OPT_SORT_KEYS = real.OPT_SORT_KEYS
        self.OPT_STRICT_INTEGER = real.OPT_STRICT_INTEGER

    def dumps(self, value: Any, option: int = 0) -> bytes:
        self._mutate()
        out: bytes = self._real.dumps(value, option=option)
        return out

    def loads(self, data: bytes) -> Any:
        return self._real.loads(data)


def test_item4_what_is_encoded_is_what_was_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value flipped to NaN after validation was admitted as ``null``."""
    args: dict[str, Any] = {"amount": 1.5, "items": [2.5]}

    def flip() -> None:
        args["amount"] = math.nan
        args["items"][0] = math.inf

    monkeypatch.setattr(canonical, "_c_canonical", None)  # the Python encoder's window
    monkeypatch.setattr(canonical, "_orjson", _MutateDuringEncode(canonical._orjson, flip))
    fence = make_fence()
    ticket = ticket_of(fence, EffectRequest("flip", "d", "t", args))
    assert ticket.args_json == b'{"amount":1.5,"items":[2.5]}'
    cert = fence.commit(ticket, None)
    assert cert.args == {"amount": 1.5, "items": [2.5]} and cert.verify()


def test_item4_any_failure_while_reading_is_a_counted_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key added or removed mid-prepare escaped as RuntimeError: not a refusal, not counted."""

    def resized(members: object) -> list[tuple[Any, Any]]:
        raise RuntimeError("dictionary changed size during iteration")

    monkeypatch.setattr(canonical, "_c_canonical", None)
    monkeypatch.setattr(canonical, "_sorted_items", resized)  # where the exact path reads
    fence = make_fence()
    with pytest.raises(InvalidRequest, match="RuntimeError"):
        fence.prepare(EffectRequest("r", "d", "t", {"a": 1.0}))  # 1.0: the exact path
    assert fence.stats()["prepare"]["invalid_request"] == 1


STATES = [
    {"a": 1.5, "b": "x"},
    {"a": 1.5, "b": "x", "c": [1, 2]},
]
VALID_BYTES = {canonical_bytes(s) for s in STATES}


def _mutations(args: dict[str, Any], ops: list[int]) -> Iterator[None]:
    """Cycle through states of ``args``: some valid (STATES), some not (NaN, Infinity)."""
    while True:
        args["a"] = math.nan
        yield
        args["a"] = 1.5
        yield
        for op in ops:
            if op == 0:
                args["a"] = math.nan
            elif op == 1:
                args["a"] = 1.5
            elif op == 2:
                args["c"] = [1, 2]
            elif op == 3:
                args.pop("c", None)
            elif op == 4 and "c" in args:
                args["c"] = [1, math.inf]
                args["c"] = [1, 2]
            yield


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ops=st.lists(st.integers(0, 4), min_size=1, max_size=8))
def test_item4_mutated_from_another_thread_admitted_with_what_it_saw_or_refused(
    ops: list[int],
) -> None:
    fence = make_fence()
    args: dict[str, Any] = {"a": 1.5, "b": "x"}
    stop = threading.Event()
    barrier = threading.Barrier(2)

    def mutate() -> None:
        steps = _mutations(args, ops)
        barrier.wait()
        while not stop.is_set():
            next(steps)

    mutator = threading.Thread(target=mutate)
    outcomes: list[str] = []
    with preemptive():
        mutator.start()
        barrier.wait()
        try:
            for i in range(1000):
                try:
                    admission = fence.prepare(EffectRequest(f"i{i}", "d", "t", args))
                except Refusal as refusal:
                    assert refusal.code == "invalid_request", refusal
                    outcomes.append("refused")
                    continue
                data = admission.ticket.args_json
                assert data in VALID_BYTES, data
                cert = fence.commit(admission.ticket, None)
                assert cert.args_json == data and cert.verify()
                outcomes.append("admitted")
        finally:
            stop.set()
            mutator.join()
    stats = fence.stats()["prepare"]
    assert stats["invalid_request"] == outcomes.count("refused")
    assert stats["admitted"] == outcomes.count("admitted")


# -- item 5: nothing but a Refusal leaves prepare or commit -------------------------------------


def test_item5_deep_nesting_with_a_high_max_depth_is_a_refusal() -> None:
    """Pure twin: RecursionError escaped prepare (uncounted) for deeply nested args. The
    highest max_depth a fence takes is deeper than the interpreter's stack allows."""
    fence = make_fence(max_depth=MAX_PAYLOAD_DEPTH)
    deep = deep_list(5000)
    with pytest.raises(InvalidRequest, match="nesting"):
        fence.prepare(EffectRequest("deep", "d", "t", {"v": deep}))
    assert fence.stats()["prepare"]["invalid_request"] == 1
    ticket = ticket_of(fence, EffectRequest("ok", "d", "t", {"v": deep_list(50)}))
    with pytest.raises(InvalidRequest, match="nesting"):
        fence.commit(ticket, deep)


def test_item5_huge_integers_are_refused_without_printing_them() -> None:
    fence = make_fence()
    for n, size in (
        (2**53, "16-digit"),
        (10**5000, "about 5000 digits"),
        (-(2**99_999), "about 30103 digits"),
    ):
        with pytest.raises(InvalidRequest, match="outside the safe range") as info:
            fence.prepare(EffectRequest("big", "d", "t", {"n": n}))
        assert size in str(info.value)
        assert "9007199254740992" not in str(info.value)  # never the value itself


class OddIter(list[Any]):
    def __iter__(self) -> Iterator[Any]:
        raise RuntimeError("odd __iter__")

    def __len__(self) -> int:
        raise ValueError("odd __len__")


class Endless(list[Any]):
    def __iter__(self) -> Iterator[Any]:
        while True:
            yield self


class LyingDict(dict[str, Any]):
    def items(self) -> Any:
        raise KeyError("odd items")

    def keys(self) -> Any:
        return iter(range(10**9))

    def __iter__(self) -> Iterator[str]:
        while True:
            yield "k"

    def __len__(self) -> int:
        return -1


class OddFloat(float):
    def __float__(self) -> float:
        raise ZeroDivisionError("odd __float__")

    def __le__(self, other: object) -> bool:
        raise ZeroDivisionError("odd __le__")


class OddInt(int):
    def __index__(self) -> int:
        raise ZeroDivisionError("odd __index__")

    def __le__(self, other: object) -> bool:
        raise ZeroDivisionError("odd __le__")


class OddStr(str):
    def __hash__(self) -> int:
        return 1

    def __eq__(self, other: object) -> bool:
        return self is other

    def encode(self, *args: Any, **kwargs: Any) -> bytes:
        raise ZeroDivisionError("odd encode")


class LiesAboutClass:
    @property  # type: ignore[misc]
    def __class__(self) -> type:
        raise ZeroDivisionError("odd __class__")


def _hostile_leaf() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.sampled_from([math.nan, math.inf, 1.0, 1e300, -0.0, "\ud800", None, True]),
        st.integers(min_value=-(2**64), max_value=2**64),
        st.integers(0, 200_000).map(lambda k: 2**k),
        st.floats().map(OddFloat),
        st.integers(-(2**60), 2**60).map(OddInt),
        st.text(max_size=4).map(OddStr),
        st.builds(LiesAboutClass),
        st.builds(object),
        st.just(b"bytes"),
        st.just({1, 2}),
    )


def _hostile_container(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.lists(children, max_size=4).map(OddIter),
        st.lists(children, max_size=3).map(Endless),
        st.dictionaries(st.text(max_size=3), children, max_size=3),
        st.dictionaries(st.text(max_size=3), children, max_size=3).map(LyingDict),
        st.dictionaries(st.text(max_size=2).map(OddStr), children, max_size=3),
        st.dictionaries(st.integers(-3, 3), children, max_size=2),
        # shared sub-structures: the same child many times over, nested
        st.tuples(children, st.integers(2, 64), st.integers(1, 24)).map(
            lambda t: _amplified(t[0], t[1], t[2])
        ),
        st.integers(200, 4000).map(deep_list),
    )


def _amplified(leaf: Any, fan_out: int, levels: int) -> Any:
    v = leaf
    for _ in range(levels):
        v = [v] * fan_out
    return v


HOSTILE = st.recursive(_hostile_leaf(), _hostile_container, max_leaves=12)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(value=HOSTILE, max_depth=st.sampled_from([8, 64, MAX_PAYLOAD_DEPTH]))
def test_item5_hostile_payloads_get_a_refusal_within_bounds(value: Any, max_depth: int) -> None:
    """Shared sub-structures, deep nesting, huge ints, subclasses with odd methods: prepare
    and commit answer (admit, or refuse with a Refusal) within 2 s and 32 MiB."""
    fence = make_fence(max_depth=max_depth, max_args_bytes=1 << 20, max_result_bytes=1 << 20)
    bounded = Bounded()
    admitted: list[PreparedEffect] = []

    def prepare() -> None:
        admitted.append(ticket_of(fence, EffectRequest("h", "d", "t", {"v": value})))

    exc = bounded.run(prepare)
    assert exc is None or isinstance(exc, Refusal), repr(exc)
    assert bounded.seconds < 2.0 and bounded.peak < 32 << 20, (bounded.seconds, bounded.peak)
    stats = fence.stats()["prepare"]
    assert stats["admitted"] + stats["invalid_request"] == 1

    ticket = admitted[0] if admitted else ticket_of(fence, EffectRequest("h2", "d", "t", {}))
    exc = bounded.run(lambda: fence.commit(ticket, value))
    assert exc is None or isinstance(exc, Refusal), repr(exc)
    assert bounded.seconds < 2.0 and bounded.peak < 32 << 20, (bounded.seconds, bounded.peak)


def test_item5_subclasses_are_read_through_their_base_type() -> None:
    """Their overrides never run: the storage is what is encoded, once."""
    value = {
        "l": OddIter([1, 2]),
        "d": LyingDict(a=1),
        "f": OddFloat(2.5),
        "i": OddInt(7),
        "s": OddStr("x"),
        "e": Endless([3]),
    }
    want = b'{"d":{"a":1},"e":[3],"f":2.5,"i":7,"l":[1,2],"s":"x"}'
    assert canonical_bytes(value) == want
    fence = make_fence()
    assert ticket_of(fence, EffectRequest("sub", "d", "t", value)).args_json == want
    # a dict subclass as the args themselves is read through dict too
    assert ticket_of(fence, EffectRequest("sub2", "d", "t", LyingDict(a=1))).args_json == (
        b'{"a":1}'
    )


def test_item5_two_keys_that_are_one_string_are_refused() -> None:
    with pytest.raises(CanonicalError, match="occurs twice"):
        canonical_bytes({OddStr("k"): 1, OddStr("k"): 2})


# -- item 6: every part of a certificate a caller can reach is immutable or a copy -------------


def _immutable(part: object) -> bool:
    if type(part) is tuple:
        return all(_immutable(p) for p in part)
    return part is None or type(part) in (str, int, bytes)


def test_item6_a_certificate_holds_only_immutable_parts() -> None:
    """Its vector clock was a live dict: mutating it changed every later replay, verify()
    then failed for everyone (G3), and a cycle through it was never collected."""
    fence = make_fence()
    request = EffectRequest("c", "d", "t", {"n": 1}, "agent-a", known_clock={"b": 2})
    cert = fence.commit(ticket_of(fence, request), {"ok": True})
    assert _immutable(tuple(cert)), [type(p).__name__ for p in cert]
    parts = [
        cert,
        copy.copy(cert),
        copy.deepcopy(cert),
        pickle.loads(pickle.dumps(cert)),
        EffectCert.from_dict(cert.to_dict()),
        EffectCert._trusted(*cert),
    ]
    for each in parts:
        assert _immutable(tuple(each)), [type(p).__name__ for p in each]
        assert each == cert and each.verify()
    # what the properties hand out are copies
    cert.vector_clock["agent-a"] = 99
    cert.args["n"] = 2
    cert.result["ok"] = False
    replay = fence.prepare(request).cert
    assert replay.vector_clock == {"b": 2, "agent-a": 1}
    assert replay.args == {"n": 1} and replay.result == {"ok": True}
    assert replay.hash == cert.hash and replay.verify()
    # nothing the cyclic GC could find a cycle through: only its type and immutable values
    assert all(_immutable(p) for p in gc.get_referents(cert) if p is not EffectCert)


def test_item6_the_constructor_refuses_mutable_clock_and_read_set_entries() -> None:
    fields = {
        "intent": "i",
        "parent": None,
        "domain": "d",
        "seq": 1,
        "tool": "t",
        "args": {},
        "result": None,
        "vector_clock": {"a": 1},
        "read_set": [("e", 2)],
        "agent": "a",
    }
    cert = EffectCert(**fields)
    assert _immutable(tuple(cert)) and cert.verify()
    assert EffectCert(**{**fields, "vector_clock": (("a", 1),)}) == cert
    for bad in (
        {"vector_clock": {"a": [1]}},
        {"vector_clock": {"a": 1.0}},
        {"read_set": [("e", [2])]},
        {"read_set": [(["e"], 2)]},
    ):
        with pytest.raises(InvalidRequest):
            EffectCert(**{**fields, **bad})


# -- item 7: chains and clocks of overlapping attempts --------------------------------------------


def test_item7_overlapping_attempts_make_a_dag_that_verifies_and_reports_them() -> None:
    """Two attempts admitted before either committed share a parent: verify_chain said
    "certificate 1 does not follow certificate 0", i.e. tampering, for what the fence did."""
    fence = make_fence()
    first = fence.commit(ticket_of(fence, EffectRequest("p", "d", "t", {}, "a")), 0)
    x = ticket_of(fence, EffectRequest("x", "d", "t", {}, "a"))
    y = ticket_of(fence, EffectRequest("y", "d", "t", {}, "b"))
    assert x.vector_clock.concurrent(y.vector_clock)  # true to what happened
    cy = fence.commit(y, 2)  # commits in the other order than they were admitted
    cx = fence.commit(x, 1)
    assert cx.parent == cy.parent == first.hash
    after = fence.commit(ticket_of(fence, EffectRequest("z", "d", "t", {}, "c")), 3)
    assert VectorClock(cx.vector_clock).lt(after.vector_clock)
    assert VectorClock(cy.vector_clock).lt(after.vector_clock)
    chain = [first, cx, cy, after]  # seq order
    assert [c.seq for c in chain] == sorted(c.seq for c in chain)
    report = verify_chain(chain)
    assert report.ok and report.broken_at is None and report.reason == ""
    assert report.concurrent == ((1, 2),)
    assert verify_chain(chain[1:]).ok  # a segment: its root is its first certificate's parent
    assert verify_chain(chain, root=None).ok
    assert not verify_chain(chain[1:], root=None).ok  # a root that is not the head it saw


def test_item7_one_agent_running_two_attempts_at_once_is_reported_concurrent() -> None:
    fence = make_fence()
    x = ticket_of(fence, EffectRequest("x", "d", "t", {}, "a"))
    y = ticket_of(fence, EffectRequest("y", "d", "t", {}, "a"))
    assert x.vector_clock == y.vector_clock  # one counter, two attempts
    report = verify_chain([fence.commit(x, 1), fence.commit(y, 2)])
    assert report.ok and report.concurrent == ((0, 1),)


def test_item7_sequential_attempts_form_a_line_with_or_without_expected_seq() -> None:
    fence = make_fence()
    certs: list[EffectCert] = []
    for i, agent in enumerate("abab"):
        expected = certs[-1].seq if certs and i % 2 else None
        request = EffectRequest(f"s{i}", "d", "t", {}, agent, expected_seq=expected)
        certs.append(fence.commit(ticket_of(fence, request), i))
    assert all(b.parent == a.hash for a, b in itertools.pairwise(certs))
    report = verify_chain(certs)
    assert report.ok and report.concurrent == ()


def test_item7_under_expected_seq_overlap_certifies_at_most_the_later_attempt() -> None:
    """current() counts admissions, so a strict attempt can be admitted at the seq after one
    still in flight; that one's commit is then refused, and the certificates stay a line."""
    fence = make_fence()
    first = fence.commit(ticket_of(fence, EffectRequest("p", "d", "t", {}, "a")), 0)
    x = ticket_of(fence, EffectRequest("x", "d", "t", {}, "a", expected_seq=fence.current("d")))
    y = ticket_of(fence, EffectRequest("y", "d", "t", {}, "b", expected_seq=fence.current("d")))
    with pytest.raises(ReadSetStale):
        fence.commit(x, 1)
    cy = fence.commit(y, 2)
    report = verify_chain([first, cy])
    assert report.ok and report.concurrent == () and cy.parent == first.hash
    # a strict attempt overlapping a non-strict one: both certified, reported concurrent
    z = ticket_of(fence, EffectRequest("z", "d", "t", {}, "a"))
    w = ticket_of(fence, EffectRequest("w", "d", "t", {}, "b", expected_seq=fence.current("d")))
    report = verify_chain([first, cy, fence.commit(z, 3), fence.commit(w, 4)])
    assert report.ok and report.concurrent == ((2, 3),)


def test_item7_edited_certificates_and_broken_links_still_fail() -> None:
    fence = make_fence()
    first = fence.commit(ticket_of(fence, EffectRequest("p", "d", "t", {}, "a")), 0)
    x = ticket_of(fence, EffectRequest("x", "d", "t", {}, "a"))
    y = ticket_of(fence, EffectRequest("y", "d", "t", {}, "b"))
    cx, cy = fence.commit(x, 1), fence.commit(y, 2)
    last = fence.commit(ticket_of(fence, EffectRequest("z", "d", "t", {}, "c")), 3)
    good = [first, cx, cy, last]
    assert verify_chain(good).ok

    edited = EffectCert.from_dict({**cy.to_dict(), "result": 999})
    report = verify_chain([first, cx, edited, last])
    assert not report.ok and report.broken_at == 2 and "does not verify" in report.reason

    fence.commit(ticket_of(fence, EffectRequest("o1", "other", "t", {}, "a")), 0)
    stranger = fence.commit(ticket_of(fence, EffectRequest("o2", "other", "t", {}, "a")), 0)
    fields = {k: v for k, v in last.to_dict().items() if k not in ("format", "hash")}
    relinked = EffectCert(**{**fields, "parent": "0" * 64})  # re-hashed: it verifies
    for bad, at, why in (
        ([first, cx, relinked], 2, "follows no earlier certificate"),
        ([first, cx, stranger], 2, "belongs to domain 'other'"),  # out of line, named so
        ([cx, last], 1, "follows no earlier certificate"),
    ):
        report = verify_chain(bad)
        assert not report.ok and report.broken_at == at, (report, at)
        assert why in report.reason


# -- the C memory store keeps what it holds out of the cyclic GC ----------------------------------


def test_c_store_keeps_records_and_certs_out_of_the_cyclic_gc() -> None:
    """Records and kept certificates hold only scalars, enum members and tuples of scalars:
    no cycle can pass through them, so the C store untracks them and a full collection does
    not walk every kept result again. Refcounting still frees them."""
    import sys

    from effectfence import _accel
    from effectfence.counters import AtomicCounterTable, new_table
    from effectfence.protocol import State
    from effectfence.store.cmemory import CMemoryStore

    if _accel.memstore is None or AtomicCounterTable is None:
        pytest.skip(f"the C memory store is not built: {_accel.memstore_error}")
    store = CMemoryStore(counters=new_table("atomic"))
    fence = EffectFence(FenceConfig(), store=store)
    adm = fence.prepare(EffectRequest("gc:1", "order:1", "charge", {"n": [1, 2]}, "a"))
    held = store.get("gc:1")
    assert held is not None and not gc.is_tracked(held)
    cert = fence.commit(adm.ticket, {"ok": [True]})
    done = store.get("gc:1")
    assert done is not None and done.cert is cert
    assert not gc.is_tracked(done) and not gc.is_tracked(cert)
    # nothing in them could lead back to them
    for value in (getattr(done, name) for name in type(done).__slots__):
        assert type(value) in (str, int, float, bytes, State, type(None), EffectCert), value

    def scalars(v: Any) -> bool:  # CPython itself untracks such tuples on its next pass
        return type(v) in (str, int, float, bytes, type(None)) or (
            type(v) is tuple and all(scalars(x) for x in v)
        )

    assert all(scalars(part) for part in cert)
    del held, cert
    before = sys.getrefcount(done)
    assert fence.clear("gc:1", reason="test", who="t") is not None
    assert sys.getrefcount(done) == before - 1  # the store let go: refcounting frees it


# -- found by review: text the audit trail must hold, reserved reasons, config types -------


@pytest.mark.parametrize("counters", ["atomic", "pure"])
def test_a_reason_that_is_not_unicode_text_changes_nothing_and_keeps_the_trail(
    counters: str,
) -> None:
    """A lone surrogate in a clear's reason deleted the record, then raised an untyped
    error, and every later audit() raised; in an abort reason it poisoned the next clear
    of that intent. Both are refused typed, before anything changes."""
    if counters == "atomic":
        from effectfence._accel import memstore

        if memstore is None:
            pytest.skip("the C memory store is not built")
    fence = make_fence(counters=counters)
    fence.abort(fence.request("pay:1", "d", "t").ticket, "timeout")
    before = fence.stats()
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        fence.clear("pay:1", reason="operator \udcff note", who="ops")
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        fence.clear("pay:1", reason="note", who="ops\udcff")
    assert fence.intent_status("pay:1").state == "failed" and fence.audit() == []
    ticket = fence.request("pay:2", "d", "t").ticket
    with pytest.raises(InvalidRequest, match="lone surrogate"):
        fence.abort(ticket, "upload of /data/r\udce9sum.pdf failed")
    assert fence.intent_status("pay:2").state == "in_flight"
    fence.abort(ticket, "upload failed")
    assert fence.clear_intent("pay:2") and [e.intent for e in fence.audit()] == ["pay:2"]
    assert fence.stats()["clears"] == before["clears"] + 1


def test_an_audit_entry_that_is_not_unicode_text_is_refused_before_any_store_step() -> None:
    from effectfence.store.codec import entry_to_json

    assert entry_to_json({"reason": "café", "id": 1}) == '{"reason":"caf\\u00e9"}'
    with pytest.raises(ValueError, match="lone surrogate"):
        entry_to_json({"previous": {"failure": "r\udce9sum"}})


def test_the_stale_commit_reason_is_reserved() -> None:
    """A commit after abort(ticket, "read_set_stale") was refused read_set_stale, a race
    that never happened, instead of lease_lost (the state table's failed row)."""
    fence = make_fence()
    ticket = fence.request("job", "d", "t").ticket
    with pytest.raises(InvalidRequest, match="reserved"):
        fence.abort(ticket, "read_set_stale")
    fence.abort(ticket, "read set stale?")
    with pytest.raises(Refusal) as refused:
        fence.commit(ticket, {})
    assert refused.value.code == "lease_lost"


@pytest.mark.parametrize(
    "field", ["max_result_bytes", "max_args_bytes", "max_depth", "sweep_batch"]
)
@pytest.mark.parametrize("value", [math.nan, 64.0, True])
def test_a_config_limit_is_a_whole_number(field: str, value: Any) -> None:
    """NaN passed every range check: max_result_bytes=nan admitted every effect and refused
    every commit after it ran; max_depth=nan turned the depth limit off."""
    with pytest.raises(ValueError, match=field):
        FenceConfig(**{field: value})


@pytest.mark.parametrize("field", ["lease_ttl", "result_ttl", "lapsed_grace", "sweep_interval"])
def test_a_duration_is_not_a_bool(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        FenceConfig(**{field: True})
    fence = make_fence()
    with pytest.raises(InvalidRequest, match="ttl"):
        fence.renew(fence.request("r", "d", "t").ticket, True)  # type: ignore[arg-type]
