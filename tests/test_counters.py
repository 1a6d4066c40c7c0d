"""The counter tables: one contract, checked on both the C atomic and the pure-Python table."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from effectfence import counters
from effectfence.counters import MAX_VALUE, CounterTable, PureCounterTable

ROOT = Path(__file__).resolve().parent.parent

TABLES = [
    pytest.param(
        "atomic",
        marks=pytest.mark.skipif(
            counters.AtomicCounterTable is None,
            reason="C extension not built (pip install -e . or python build_ffi.py)",
        ),
    ),
    pytest.param("pure"),
]


def make(name: str) -> CounterTable:
    return counters.new_table(name)


@pytest.fixture(params=TABLES)
def table(request: pytest.FixtureRequest) -> CounterTable:
    return make(request.param)


def snapshot(t: CounterTable) -> tuple[dict[str, int | None], int, int]:
    return {d: t.load(d) for d in t.domains()}, t.floor(), len(t)


# --- unit tests -----------------------------------------------------------------------------


def test_conforms_to_protocol(table: CounterTable) -> None:
    assert isinstance(table, CounterTable)
    assert table.backend in ("atomic", "pure")
    assert len(table) == 0 and table.domains() == [] and table.floor() == 0


def test_slot_get_or_create(table: CounterTable) -> None:
    s = table.slot("a")
    assert s >= 0 and table.slot("a") == s and table.find("a") == s
    assert table.slot("b") != s
    assert table.load("a") == 0 and table.load_slot(s) == 0
    assert sorted(table.domains()) == ["a", "b"] and len(table) == 2


def test_find_and_load_never_create(table: CounterTable) -> None:
    assert table.find("nope") == -1
    assert table.load("nope") is None
    assert len(table) == 0 and table.domains() == []


def test_reserve_returns_new_value(table: CounterTable) -> None:
    assert [table.reserve("d") for _ in range(3)] == [1, 2, 3]
    s = table.find("d")
    assert table.reserve_slot(s) == 4 and table.load_slot(s) == 4 and table.load("d") == 4


def test_advance_if_fused(table: CounterTable) -> None:
    assert table.advance_if("d", 0) == 1  # creates at floor, then advances
    assert table.advance_if("d", 0) == -2  # current is 1: -(1 + 1)
    assert table.advance_if("d", 5) == -2
    s = table.find("d")
    assert table.advance_if_slot(s, 1) == 2
    assert table.advance_if_slot(s, 1) == -3
    assert table.load("d") == 2


def test_advance_if_failure_always_negative_even_at_zero(table: CounterTable) -> None:
    table.slot("d")
    assert table.advance_if("d", 3) == -1  # current 0 -> -(0 + 1)
    assert table.load("d") == 0


def test_advance_if_creates_at_floor_on_failure(table: CounterTable) -> None:
    assert table.advance_if("new", 7) == -1
    assert table.find("new") >= 0 and table.load("new") == 0


def test_compare_exchange(table: CounterTable) -> None:
    assert table.compare_exchange("d", 0, 10) == (True, 0)
    assert table.compare_exchange("d", 0, 20) == (False, 10)
    assert table.load("d") == 10
    assert table.compare_exchange("d", 10, 10) == (True, 10)


def test_evict_then_recreate_starts_above_old_value(table: CounterTable) -> None:
    for _ in range(5):
        table.reserve("d")
    old_slot = table.find("d")
    assert table.evict("d") == 5
    assert table.find("d") == -1 and table.load("d") is None and len(table) == 0
    assert table.floor() > 5
    # No ABA: neither the old current value nor any old reservation can match again.
    assert table.advance_if("d", 5) < 0
    assert table.load("d") is not None and table.load("d") > 5  # type: ignore[operator]
    assert table.reserve("d") > 5
    assert table.find("d") >= 0
    # Other domains are unaffected; brand-new domains start at the floor.
    assert table.load("fresh") is None
    table.slot("fresh")
    assert table.load("fresh") == table.floor()
    del old_slot


def test_evict_absent_and_floor_monotonic(table: CounterTable) -> None:
    assert table.evict("none") is None and table.floor() == 0
    table.compare_exchange("big", 0, 100)
    table.slot("small")
    assert table.evict("big") == 100
    floor = table.floor()
    assert table.evict("small") == 0
    assert table.floor() == floor  # never lowered


def test_evicted_slot_is_reused_at_floor(table: CounterTable) -> None:
    table.compare_exchange("a", 0, 50)
    table.evict("a")
    table.slot("b")
    assert table.load("b") == table.floor() > 50


def test_many_domains_grow_without_moving(table: CounterTable) -> None:
    slots = [table.slot(f"d{i}") for i in range(5000)]  # spans several C segments
    assert len(set(slots)) == 5000
    for s in slots[::7]:
        table.reserve_slot(s)
    assert all(table.load_slot(s) == (1 if i % 7 == 0 else 0) for i, s in enumerate(slots))


# --- bad input: clear error, nothing changes -------------------------------------------------

BAD_CALLS: list[tuple[str, Callable[[CounterTable], object], type[Exception]]] = [
    ("slot non-str", lambda t: t.slot(5), TypeError),  # type: ignore[arg-type]
    ("slot unhashable", lambda t: t.slot([]), TypeError),  # type: ignore[arg-type]
    ("find non-str", lambda t: t.find(b"x"), TypeError),  # type: ignore[arg-type]
    ("load non-str", lambda t: t.load(None), TypeError),  # type: ignore[arg-type]
    ("reserve non-str", lambda t: t.reserve(1.5), TypeError),  # type: ignore[arg-type]
    ("evict non-str", lambda t: t.evict(3), TypeError),  # type: ignore[arg-type]
    ("advance_if non-int", lambda t: t.advance_if("x", "1"), TypeError),  # type: ignore[arg-type]
    ("advance_if float", lambda t: t.advance_if("x", 1.0), TypeError),  # type: ignore[arg-type]
    ("advance_if negative", lambda t: t.advance_if("x", -1), ValueError),
    ("advance_if max", lambda t: t.advance_if("x", MAX_VALUE), OverflowError),
    ("advance_if huge", lambda t: t.advance_if("x", 2**70), OverflowError),
    ("cas negative new", lambda t: t.compare_exchange("x", 0, -1), ValueError),
    ("cas overflow new", lambda t: t.compare_exchange("x", 0, 2**63 - 1), OverflowError),
    ("cas negative exp", lambda t: t.compare_exchange("x", -5, 1), ValueError),
    ("cas non-int", lambda t: t.compare_exchange("x", 0, "1"), TypeError),  # type: ignore[arg-type]
    ("existing advance_if neg", lambda t: t.advance_if("e", -1), ValueError),
    ("existing advance_if str", lambda t: t.advance_if("e", "0"), TypeError),  # type: ignore[arg-type]
    ("existing cas overflow", lambda t: t.compare_exchange("e", 3, 2**63), OverflowError),
    ("existing cas neg", lambda t: t.compare_exchange("e", 3, -2), ValueError),
    ("load_slot negative", lambda t: t.load_slot(-1), ValueError),
    ("load_slot unallocated", lambda t: t.load_slot(2**40), ValueError),
    ("reserve_slot negative", lambda t: t.reserve_slot(-3), ValueError),
    ("reserve_slot str", lambda t: t.reserve_slot("0"), TypeError),  # type: ignore[arg-type]
    ("advance_if_slot bad", lambda t: t.advance_if_slot(-1, 0), ValueError),
    ("advance_if_slot neg", lambda t: t.advance_if_slot(t.find("e"), -1), ValueError),
]


@pytest.mark.parametrize(("what", "call", "error"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_and_changes_nothing(
    table: CounterTable, what: str, call: Callable[[CounterTable], object], error: type[Exception]
) -> None:
    table.reserve("e")
    table.reserve("e")
    table.reserve("e")
    before = snapshot(table)
    with pytest.raises(error) as info:
        call(table)
    assert str(info.value)  # says something
    assert snapshot(table) == before


def test_overflow_refused_and_unchanged(table: CounterTable) -> None:
    assert table.compare_exchange("m", 0, MAX_VALUE) == (True, 0)
    with pytest.raises(OverflowError):
        table.reserve("m")
    with pytest.raises(OverflowError):
        table.reserve_slot(table.find("m"))
    with pytest.raises(OverflowError):
        table.advance_if("m", MAX_VALUE)
    assert table.advance_if("m", MAX_VALUE - 1) == -(MAX_VALUE + 1)
    assert table.load("m") == MAX_VALUE
    assert table.compare_exchange("m", MAX_VALUE, 7) == (True, MAX_VALUE)


def test_messages_name_the_problem(table: CounterTable) -> None:
    with pytest.raises(TypeError, match="domain must be a str"):
        table.slot(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected must be >= 0"):
        table.advance_if("d", -1)
    with pytest.raises(OverflowError, match="2\\*\\*63-2"):
        table.compare_exchange("d", 0, 2**63 - 1)
    with pytest.raises(ValueError, match="is not live"):
        table.load_slot(10**12)


# --- parity: the same bad input is refused the same way by both tables ------------------------

I64 = 2**63  # first int past int64: the C shim gets it clamped, the pure table sees it as is


@dataclass
class Scene:
    """A table with a live domain "e" at 3, and slots it must refuse although they once were,
    or elsewhere are, real slots."""

    t: CounterTable
    other: CounterTable  # another table of the same backend, with a live domain "o"
    evicted: int  # a slot of a domain this table evicted
    reused: int  # a slot of an evicted domain whose storage a new domain took over
    other_evicted: int  # a slot of a domain another table evicted
    dead: int  # a slot of a table that was garbage-collected

    def snapshot(self) -> object:
        return snapshot(self.t), snapshot(self.other)


def make_scene(name: str) -> Scene:
    dead_table = make(name)
    dead = dead_table.slot("z")
    del dead_table
    gc.collect()  # its finalizer frees its slots (atomic: back to the process-wide free list)
    t, other = make(name), make(name)
    for _ in range(3):
        t.reserve("e")
    evicted = t.slot("gone")
    t.evict("gone")
    reused = t.slot("was")
    t.evict("was")
    t.slot("now")  # the atomic table lends the evicted cell out again, under a new handle
    other.reserve("o")
    other_evicted = other.slot("x")
    other.evict("x")
    return Scene(t, other, evicted, reused, other_evicted, dead)


SceneCall = Callable[[Scene], object]
#: (id, call, exception, message fragment).  Every row raised a different exception type, or
#: none at all, on the atomic table before: cffi refused an int outside int64 with
#: OverflowError before the shim could name it, and the C table took any allocated index.
PARITY_CALLS: list[tuple[str, SceneCall, type[Exception], str]] = [
    # slots outside int64 are slots that were never handed out: ValueError
    ("load_slot 2**63", lambda s: s.t.load_slot(I64), ValueError, "is not live"),
    ("load_slot -2**63-1", lambda s: s.t.load_slot(-I64 - 1), ValueError, "is not live"),
    ("reserve_slot 2**64", lambda s: s.t.reserve_slot(2**64), ValueError, "is not live"),
    ("reserve_slot -2**70", lambda s: s.t.reserve_slot(-(2**70)), ValueError, "is not live"),
    ("advance_if_slot 2**63", lambda s: s.t.advance_if_slot(I64, 0), ValueError, "is not live"),
    # a bad slot is reported before a bad value, as before
    ("advance_if_slot both", lambda s: s.t.advance_if_slot(-I64 - 1, I64), ValueError, "slot"),
    # values outside int64: negative is ValueError, past the maximum is OverflowError
    (
        "advance_if_slot exp -2**63-1",
        lambda s: s.t.advance_if_slot(s.t.find("e"), -I64 - 1),
        ValueError,
        "expected must be >= 0",
    ),
    (
        "advance_if_slot exp 2**64",
        lambda s: s.t.advance_if_slot(s.t.find("e"), 2**64),
        OverflowError,
        "expected .* exceeds the counter maximum",
    ),
    ("advance_if exp -2**64", lambda s: s.t.advance_if("e", -(2**64)), ValueError, "expected"),
    ("cas exp -2**63-1", lambda s: s.t.compare_exchange("e", -I64 - 1, 1), ValueError, "expected"),
    ("cas new -2**64", lambda s: s.t.compare_exchange("e", 3, -(2**64)), ValueError, "new must"),
    ("cas new 2**63", lambda s: s.t.compare_exchange("e", 3, I64), OverflowError, "new .* exceeds"),
    ("cas both", lambda s: s.t.compare_exchange("e", I64, -I64 - 1), OverflowError, "expected"),
    ("cas new domain", lambda s: s.t.compare_exchange("n", -(2**64), 1), ValueError, "expected"),
    # slots this table never handed out, or no longer holds
    ("bare index 0", lambda s: s.t.reserve_slot(0), ValueError, "is not live"),
    ("bare index 1", lambda s: s.t.load_slot(1), ValueError, "is not live"),
    ("bool slot", lambda s: s.t.reserve_slot(True), ValueError, "is not live"),
    ("live slot + 1", lambda s: s.t.reserve_slot(s.t.find("e") + 1), ValueError, "is not live"),
    ("evicted reserve", lambda s: s.t.reserve_slot(s.evicted), ValueError, "is not live"),
    ("evicted load", lambda s: s.t.load_slot(s.evicted), ValueError, "is not live"),
    ("evicted advance", lambda s: s.t.advance_if_slot(s.evicted, 0), ValueError, "is not live"),
    ("reused reserve", lambda s: s.t.reserve_slot(s.reused), ValueError, "is not live"),
    ("reused load", lambda s: s.t.load_slot(s.reused), ValueError, "is not live"),
    ("reused advance", lambda s: s.t.advance_if_slot(s.reused, 0), ValueError, "is not live"),
    ("other evicted", lambda s: s.t.reserve_slot(s.other_evicted), ValueError, "is not live"),
    ("dead table", lambda s: s.t.reserve_slot(s.dead), ValueError, "is not live"),
    ("dead table load", lambda s: s.t.load_slot(s.dead), ValueError, "is not live"),
    # values that are not ints: cffi took __int__ (Fraction(1, 2) became 0) and acted, and
    # compare_exchange swapped while it answered that it had not (found by review)
    (
        "advance_if_slot Fraction",
        lambda s: s.t.advance_if_slot(s.t.find("e"), Fraction(1, 2)),
        TypeError,
        "int",
    ),
    ("advance_if Decimal", lambda s: s.t.advance_if("e", Decimal(3)), TypeError, "int"),
    ("cas Fraction", lambda s: s.t.compare_exchange("e", Fraction(1, 2), 7), TypeError, "int"),
    ("cas new Decimal", lambda s: s.t.compare_exchange("e", 3, Decimal(7)), TypeError, "int"),
    # a slot that is not an int but equals one: the pure table's dict found the slot by it
    ("Fraction slot load", lambda s: s.t.load_slot(Fraction(s.t.find("e"))), TypeError, "int"),
    (
        "Fraction slot reserve",
        lambda s: s.t.reserve_slot(Fraction(s.t.find("e"))),
        TypeError,
        "int",
    ),
    ("float slot reserve", lambda s: s.t.reserve_slot(float(s.t.find("e"))), TypeError, "int"),
    (
        "Fraction slot advance",
        lambda s: s.t.advance_if_slot(Fraction(s.t.find("e")), 3),
        TypeError,
        "int",
    ),
]


@pytest.mark.parametrize(
    ("what", "call", "error", "message"), PARITY_CALLS, ids=[c[0] for c in PARITY_CALLS]
)
@pytest.mark.parametrize("name", TABLES)
def test_both_tables_refuse_the_same_way(
    name: str, what: str, call: SceneCall, error: type[Exception], message: str
) -> None:
    """Same exception type (the one the contract names) on both tables; nothing changes."""
    scene = make_scene(name)
    before = scene.snapshot()
    with pytest.raises(error, match=message):
        call(scene)
    assert scene.snapshot() == before


def test_load_of_a_domain_evicted_after_its_slot_was_found_is_absent(table: CounterTable) -> None:
    """The memory store's current() reads without a lock and retries a read that crossed an
    eviction; load() found the slot, the eviction killed it, and the read raised (not live,
    or KeyError) out of current() instead of answering (found by review)."""
    table.reserve("d")
    real_find = table.find

    def find_then_evicted(domain: str) -> int:
        table.find = real_find  # type: ignore[method-assign]  # once
        slot = real_find(domain)
        table.evict(domain)  # the eviction lands between find() and the read
        return slot

    table.find = find_then_evicted  # type: ignore[method-assign]
    assert table.load("d") is None  # absent, as the table now says


@pytest.mark.skipif(counters.AtomicCounterTable is None, reason="C extension not built")
def test_atomic_slots_live_through_interpreter_exit(tmp_path: Path) -> None:
    """The tables' finalizers ran at exit and killed every slot, the process's token slot
    among them, while atexit hooks registered earlier and daemon threads still used them
    (found by review)."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import atexit\n"
        "from effectfence import EffectFence, EffectRequest\n"
        "fence = None\n"
        "def late():\n"
        "    fence.prepare(EffectRequest('late', 'd', 't', {}, 'a'))\n"
        "    print('late prepare ok')\n"
        "atexit.register(late)  # before any table: it runs after their finalizers would\n"
        "fence = EffectFence()\n"
        "fence.prepare(EffectRequest('early', 'd', 't', {}, 'a'))\n"
    )
    env = {**os.environ, "EFFECTFENCE_COUNTERS": "atomic"}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=60
    )
    assert "late prepare ok" in out.stdout, out.stderr[-2000:]


def test_live_slot_of_another_table(table: CounterTable) -> None:
    """The one documented difference: the C slot calls do not know their table, so a live slot
    of another atomic table acts on *that* table's counter; the pure table refuses it.  Either
    way this table's counters are untouched."""
    other = make(table.backend)
    foreign = other.slot("o")
    table.reserve("e")
    before = snapshot(table)
    if table.backend == "pure":
        with pytest.raises(ValueError, match="is not live"):
            table.reserve_slot(foreign)
    else:
        assert table.reserve_slot(foreign) == 1 and other.load("o") == 1
    assert snapshot(table) == before


# --- both tables agree on random operation sequences ------------------------------------------

DOMAINS = st.sampled_from(["a", "b", "c", "d"])
VALUES = st.one_of(st.integers(0, 6), st.just(MAX_VALUE), st.integers(-2, -1))
OPS = st.one_of(
    st.tuples(st.just("slot"), DOMAINS),
    st.tuples(st.just("find_ok"), DOMAINS),
    st.tuples(st.just("load"), DOMAINS),
    st.tuples(st.just("reserve"), DOMAINS),
    st.tuples(st.just("reserve_slot"), DOMAINS),
    st.tuples(st.just("advance_if"), DOMAINS, VALUES),
    st.tuples(st.just("advance_if_slot"), DOMAINS, VALUES),
    st.tuples(st.just("compare_exchange"), DOMAINS, VALUES, VALUES),
    st.tuples(st.just("evict"), DOMAINS),
    # the slot this domain had when last looked up: stale once the domain was evicted
    st.tuples(st.just("remembered"), st.sampled_from(["load_slot", "reserve_slot"]), DOMAINS),
    st.tuples(st.just("remembered"), st.just("advance_if_slot"), DOMAINS, VALUES),
    st.tuples(st.just("floor")),
    st.tuples(st.just("len")),
    st.tuples(st.just("domains")),
)


def apply(t: CounterTable, op: tuple[object, ...], seen: dict[str, int] | None = None) -> object:
    """Run one op; exceptions become their type name so both tables can be compared.

    ``seen`` remembers each domain's last slot, for the "remembered" ops.
    """
    name, *args = op
    seen = {} if seen is None else seen
    try:
        if name == "remembered":
            method, domain, *rest = args
            if domain not in seen:
                return "never seen"
            return getattr(t, str(method))(seen[str(domain)], *rest)
        if name in ("find_ok", "slot", "reserve_slot", "advance_if_slot"):
            slot = t.find(str(args[0]))
            if slot >= 0:
                seen[str(args[0])] = slot
        if name == "find_ok":
            return t.find(str(args[0])) >= 0
        if name in ("reserve_slot", "advance_if_slot"):
            slot = t.find(str(args[0]))
            if slot < 0:
                return "absent"
            return getattr(t, name)(slot, *args[1:])
        if name == "len":
            return len(t)
        if name == "domains":
            return sorted(t.domains())
        if name == "slot":
            seen[str(args[0])] = t.slot(str(args[0]))
            return None
        return getattr(t, str(name))(*args)
    except (TypeError, ValueError, OverflowError) as exc:
        return type(exc).__name__


@pytest.mark.skipif(counters.AtomicCounterTable is None, reason="C extension not built")
@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=60))
def test_atomic_and_pure_agree(ops: list[tuple[object, ...]]) -> None:
    atomic, pure = make("atomic"), make("pure")
    seen_atomic: dict[str, int] = {}
    seen_pure: dict[str, int] = {}
    for op in ops:
        assert apply(atomic, op, seen_atomic) == apply(pure, op, seen_pure), op
    assert snapshot(atomic) == snapshot(pure)


FEW_DOMAINS = st.sampled_from(["a", "b"])
#: Slot lifecycles: look up, evict, re-create, then use the slot remembered from before.
SLOT_OPS = st.one_of(
    st.tuples(st.just("slot"), FEW_DOMAINS),
    st.tuples(st.just("evict"), FEW_DOMAINS),
    st.tuples(st.just("reserve"), FEW_DOMAINS),
    st.tuples(st.just("remembered"), st.sampled_from(["load_slot", "reserve_slot"]), FEW_DOMAINS),
    st.tuples(st.just("remembered"), st.just("advance_if_slot"), FEW_DOMAINS, VALUES),
)


@pytest.mark.skipif(counters.AtomicCounterTable is None, reason="C extension not built")
@settings(max_examples=200, deadline=None)
@given(st.lists(SLOT_OPS, max_size=30))
def test_stale_slots_agree(ops: list[tuple[object, ...]]) -> None:
    """A slot kept past its domain's eviction is refused by both tables, even once the atomic
    table lent its cell to a new domain; a live one works the same on both."""
    atomic, pure = make("atomic"), make("pure")
    seen_atomic: dict[str, int] = {}
    seen_pure: dict[str, int] = {}
    for op in ops:
        assert apply(atomic, op, seen_atomic) == apply(pure, op, seen_pure), op
    assert snapshot(atomic) == snapshot(pure)


# --- real OS threads --------------------------------------------------------------------------


def run_threads(n: int, body: Callable[[int], None]) -> None:
    errors: list[BaseException] = []

    def wrapped(i: int) -> None:
        try:
            body(i)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


@pytest.fixture(autouse=False)
def fast_switching() -> object:
    """Switch threads often so races actually interleave."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield None
    sys.setswitchinterval(old)


@pytest.mark.parametrize("op", ["advance_if", "advance_if_slot", "compare_exchange"])
def test_one_winner_per_expected_value(
    table: CounterTable, op: str, fast_switching: object
) -> None:
    n, trials = 8, 100
    slot = table.slot("race")
    barrier = threading.Barrier(n)
    results: list[list[int | tuple[bool, int]]] = [[] for _ in range(trials)]

    def body(_: int) -> None:
        for trial in range(trials):
            barrier.wait()
            if op == "advance_if":
                r: int | tuple[bool, int] = table.advance_if("race", trial)
            elif op == "advance_if_slot":
                r = table.advance_if_slot(slot, trial)
            else:
                r = table.compare_exchange("race", trial, trial + 1)
            results[trial].append(r)
            barrier.wait()

    run_threads(n, body)
    for trial, rs in enumerate(results):
        if op == "compare_exchange":
            winners = [r for r in rs if isinstance(r, tuple) and r[0]]
            assert all(r == (False, trial + 1) for r in rs if r not in winners)
        else:
            winners = [r for r in rs if r == trial + 1]
            assert all(r == -(trial + 2) for r in rs if r not in winners)
        assert len(winners) == 1, (trial, rs)
    assert table.load("race") == trials


@pytest.mark.parametrize("by_slot", [False, True])
def test_32_threads_reserve_unique_and_gapless(
    table: CounterTable, by_slot: bool, fast_switching: object
) -> None:
    n, per = 32, 500
    slot = table.slot("hot")
    barrier = threading.Barrier(n)
    got: list[list[int]] = [[] for _ in range(n)]

    def body(i: int) -> None:
        barrier.wait()
        out = got[i]
        for _ in range(per):
            out.append(table.reserve_slot(slot) if by_slot else table.reserve("hot"))

    run_threads(n, body)
    values = sorted(v for vs in got for v in vs)
    assert values == list(range(1, n * per + 1))
    assert all(vs == sorted(vs) for vs in got)  # each thread sees strictly increasing seqs


def test_concurrent_create_gives_one_slot(table: CounterTable, fast_switching: object) -> None:
    n = 16
    barrier = threading.Barrier(n)
    slots: list[int] = []

    def body(i: int) -> None:
        barrier.wait()
        for k in range(200):
            slots.append(table.slot(f"d{k}"))
            table.reserve(f"d{k}")

    run_threads(n, body)
    assert len(table) == 200
    assert all(table.load(f"d{k}") == n for k in range(200))
    assert len({table.find(f"d{k}") for k in range(200)}) == 200


# --- backend choice ---------------------------------------------------------------------------


def run_python(code: str, env_value: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop(counters.ENV_VAR, None)
    if env_value is not None:
        env[counters.ENV_VAR] = env_value
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


PRINT_BACKEND = (
    "from effectfence import counters as c; print(c.BACKEND, c.new_table().backend, "
    "c.backend_info()['backend'])"
)


def test_env_forces_pure() -> None:
    r = run_python(PRINT_BACKEND, "pure")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["pure", "pure", "pure"]


@pytest.mark.skipif(counters.AtomicCounterTable is None, reason="C extension not built")
def test_env_forces_atomic_and_default_is_atomic() -> None:
    for value in ("atomic", " ATOMIC ", None, ""):
        r = run_python(PRINT_BACKEND, value)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["atomic"] * 3, value


def test_env_bad_value_is_a_clear_error() -> None:
    r = run_python("import effectfence.counters", "fast")
    assert r.returncode != 0
    assert "ValueError" in r.stderr and counters.ENV_VAR in r.stderr and "'fast'" in r.stderr


def test_forcing_atomic_without_extension_names_the_variable() -> None:
    # Hide the extension: a meta-path finder that refuses to import it.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'effectfence._effectfence_atomic':\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "try:\n"
        "    import effectfence.counters\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    r = run_python(code, "atomic")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("CounterBackendUnavailable") and counters.ENV_VAR in r.stdout
    # Without forcing, the same situation falls back to pure and says why.
    fallback = code.replace(
        "    import effectfence.counters\n",
        "    import effectfence.counters as c; print(c.BACKEND, c.backend_info())\n",
    )
    r = run_python(fallback, None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("pure ") and "blocked for the test" in r.stdout


def test_new_table_by_name() -> None:
    assert isinstance(counters.new_table("pure"), PureCounterTable)
    with pytest.raises(ValueError, match="not valid"):
        counters.new_table("turbo")


def test_backend_info_shape() -> None:
    info = counters.backend_info()
    assert info["backend"] == counters.BACKEND
    assert set(info) >= {"backend", "fallback_reason", "gil_kept", "c_version"}
    if counters.AtomicCounterTable is not None:
        assert info["gil_kept"] is True and isinstance(info["c_version"], str)


# --- the GIL is kept across C calls ----------------------------------------------------------


@pytest.mark.skipif(counters.AtomicCounterTable is None, reason="C extension not built")
def test_c_calls_keep_the_gil() -> None:
    from effectfence import _atomic

    # Called through the same cffi wrapper shape as every counter function: if the wrapper had
    # released the GIL around the call, PyGILState_Check() inside it would return 0.
    assert _atomic.gil_held() is True
    assert _atomic.ABI == _atomic.EXPECTED_ABI
