"""Regressions from an adversarial review of the core. Each test failed on the code it was
written against and passes since the defect was fixed; ranked by severity as reported.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from support import STORES, FakeClock, FenceFactory

from effectfence import EffectFence, FenceConfig
from effectfence.canonical import MAX_SAFE_INTEGER
from effectfence.counters import new_table
from effectfence.decorator import fenced
from effectfence.errors import InvalidRequest, LeaseLost, ReadSetStale
from effectfence.model import MAX_KNOWN_COUNTER, EffectRequest
from effectfence.store.cmemory import CMemoryStore
from effectfence.store.memory import MemoryStore

KINDS = sorted(k.removeprefix("memory-") for k in STORES if k.startswith("memory-"))


# -- helpers ---------------------------------------------------------------------------------


class HookedCounters:
    """A counter table that runs a one-shot hook right before ``reserve``/``advance_if``: the
    other party of a race *inside* one store step (between its read-set check and its
    reservation)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.backend = inner.backend
        self.hooks: list[Any] = []

    def reserve(self, domain: str) -> int:
        if self.hooks:
            self.hooks.pop(0)()
        return int(self.inner.reserve(domain))

    def advance_if(self, domain: str, expected: int) -> int:
        if self.hooks:
            self.hooks.pop(0)()
        return int(self.inner.advance_if(domain, expected))

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class HookedWheel(dict):  # type: ignore[type-arg]
    """The timing wheel, with a one-shot hook run after ``get`` found an existing bucket and
    before the caller appends to it (a thread preempted between the two steps)."""

    hook: Any = None

    def get(self, key: Any, default: Any = None) -> Any:
        value = super().get(key, default)
        if value is not None and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return value


def _two_stripes(store: MemoryStore) -> tuple[str, str]:
    a = "withdraw:a"
    for i in range(1000):
        b = f"withdraw:b{i}"
        if store._stripe(b) != store._stripe(a):
            return a, b
    raise AssertionError("no second stripe")


# -- 1. G6: a read-set entry on the ticket's own domain is not atomic with the reservation -----


@pytest.mark.parametrize("kind", KINDS)
def test_own_domain_read_set_is_checked_atomically_with_the_reservation(kind: str) -> None:
    """Two withdrawals decided on the same view of ``acct`` (read_set [("acct", S)], no
    expected_seq). The store checks the read set, then fetch-adds: another intent (other
    stripe) reserves in between, so A reserves S+2 although it was admitted on "acct at S".
    Both are admitted, both effects run; A is only caught at commit (FAILED, money moved).
    The claim should refuse A read_set_stale before it runs (compare-exchange S -> S+1)."""
    clock = FakeClock()
    # "c": the C claim step (store.cmemory) over the atomic table
    counters = HookedCounters(new_table("atomic" if kind == "c" else kind))
    cls = CMemoryStore if kind == "c" else MemoryStore
    store = cls(clock=clock, counters=counters)  # type: ignore[arg-type]
    fence = EffectFence(FenceConfig(auto_sweep=False), store=store)
    a, b = _two_stripes(store)
    s = fence.current("acct")
    other: dict[str, Any] = {}

    def b_decides_on_the_same_view() -> None:
        other["b"] = fence.request(b, "acct", "withdraw", {"amt": 5}, "bob", read_set=[("acct", s)])

    counters.hooks.append(b_decides_on_the_same_view)
    try:
        adm = fence.request(a, "acct", "withdraw", {"amt": 5}, "alice", read_set=[("acct", s)])
    except ReadSetStale:
        adm = None
    assert other["b"].fresh and other["b"].ticket.seq == s + 1
    assert adm is None, (
        f"A was admitted on a stale view of its own domain: read_set says acct at {s}, "
        f"its reservation is seq {adm.ticket.seq}; both effects will run"
    )


# -- 2. fail-closed: identity fields a certificate cannot encode are found only at commit -----

_UNENCODABLE = {
    "intent": dict(intent="pay:\ud800", domain="d", tool="t"),
    "agent": dict(intent="pay:agent", domain="d", tool="t", agent="\udc00"),
    "parent": dict(intent="pay:parent", domain="d", tool="t", parent="\ud800"),
    "read_set_domain": dict(intent="pay:rs", domain="d", tool="t", read_set=[("\ud800", 0)]),
    "known_clock_agent": dict(intent="pay:kc", domain="d", tool="t", known_clock={"\ud800": 1}),
    "known_clock_at_max": dict(
        intent="pay:max", domain="d", tool="t", agent="a", known_clock={"a": MAX_SAFE_INTEGER}
    ),
}


@pytest.mark.parametrize("case", sorted(_UNENCODABLE))
def test_unencodable_request_is_refused_before_the_effect_runs(
    fence: EffectFence, clock: FakeClock, case: str
) -> None:
    """DESIGN: unrepresentable values are refused "with a clear error before anything runs".
    These pass prepare, the effect runs, and commit raises invalid_request forever; the lease
    stays, lapses, and the retry is admitted again: the effect runs twice."""
    kw = _UNENCODABLE[case]
    runs = 0
    for _ in range(2):  # a caller that retries after the lease lapses
        try:
            adm = fence.request(**kw)
        except InvalidRequest:
            break  # fixed: refused before anything ran
        runs += 1  # ... the effect runs here ...
        with pytest.raises(InvalidRequest):
            fence.commit(adm.ticket, {"ok": True})
        clock.advance(10.0)
    assert runs == 0, f"{case}: admitted and ran {runs} time(s), then could not commit"
    assert fence.store.size()["records"] == 0


# -- 3. G1 vs G8: auto-sweep deletes a lapsed lease whose holder could still commit -----------


def test_lapsed_holder_not_taken_over_can_commit_despite_auto_sweep(
    make_fence: FenceFactory, clock: FakeClock
) -> None:
    """DESIGN: "A holder whose lease lapsed may still commit while no one has taken over."
    With auto_sweep (the default) ANY prepare of ANY intent deletes the lapsed record, so the
    holder's commit is lease_lost and a later duplicate is admitted Fresh with takeover=False:
    the effect runs twice, and nothing tells the second runner a first attempt existed."""
    fence = make_fence(lease_ttl=10.0, result_ttl=100.0, auto_sweep=True)
    held = fence.request("charge:1", "order:1", "charge", {"amt": 5}, "a").ticket
    clock.advance(10.5)  # the effect ran a little longer than the lease
    fence.request("unrelated", "other", "noop")  # any traffic triggers the sweep
    try:
        cert = fence.commit(held, {"charged": True})
    except LeaseLost:
        dup = fence.request("charge:1", "order:1", "charge", {"amt": 5}, "b")
        pytest.fail(
            f"no takeover happened, yet the holder's commit was refused; the duplicate "
            f"got fresh={dup.fresh} takeover={getattr(dup, 'takeover', None)} (runs again)"
        )
    assert fence.request("charge:1", "order:1", "charge", {"amt": 5}, "b").cert == cert


# -- 4. G3: a replayed result is the stored certificate's own object --------------------------


def test_mutating_a_replayed_result_does_not_change_the_recorded_certificate(
    fence: EffectFence,
) -> None:
    req = ("refund:7", "order:7", "refund", {"amt": 5}, "a")
    cert = fence.commit(fence.request(*req).ticket, {"status": "ok", "ids": [1]})
    first = fence.request(*req)
    first.result["status"] = "tampered"  # an ordinary caller editing what it got back
    first.result["ids"].append(2)
    again = fence.request(*req).cert
    assert again.verify(), "the stored certificate no longer verifies (G3)"
    assert again.result == {"status": "ok", "ids": [1]} and again.hash == cert.hash


def test_decorator_duplicate_return_value_is_not_the_stored_certificate(
    fence: EffectFence,
) -> None:
    @fenced(fence, intent="ship:{n}", domain="order:{n}")
    def ship(n: int) -> dict[str, Any]:
        return {"tracking": ["T1"]}

    ship(1)
    dup = ship(1)  # a duplicate: gets the recorded result
    dup["tracking"].append("T2")
    assert ship.call_with_cert(1).cert.verify(), "a caller's edit corrupted the record (G3)"  # type: ignore[attr-defined]


# -- 5. fail-closed: exceptions after a partial write ------------------------------------------


def test_renew_with_a_huge_ttl_does_not_change_state_then_raise(fence: EffectFence) -> None:
    """ttl passes validation (finite), the store installs the new lease, then the timing
    wheel's ``math.ceil(deadline / g)`` overflows: OverflowError after the state changed."""
    t = fence.request("i", "d", "t").ticket
    before = fence.intent_status("i").lease_until
    try:
        fence.renew(t, ttl=sys.float_info.max)
    except InvalidRequest:
        assert fence.intent_status("i").lease_until == before  # refused, nothing changed
    # otherwise it must have succeeded cleanly (no OverflowError escaping)


def test_huge_lease_ttl_does_not_leave_an_orphan_lease(store_kind: str, clock: FakeClock) -> None:
    """FenceConfig accepts lease_ttl=sys.float_info.max; the claim installs the record and
    counts it in flight, then _schedule overflows: the caller gets OverflowError and no
    ticket, and the intent is blocked (and its domain unevictable) for ~forever."""
    try:
        fence = EffectFence(
            FenceConfig(auto_sweep=False, lease_ttl=sys.float_info.max),
            store=STORES[store_kind](clock),
        )
    except ValueError:
        return  # fixed: refused at configuration
    try:
        fence.request("i", "d", "t")
    except InvalidRequest:
        pass
    except OverflowError:
        assert fence.intent_status("i").state == "absent", "a lease nobody holds was left"
        raise


def test_commit_with_a_huge_result_ttl_does_not_raise_after_committing(
    store_kind: str, clock: FakeClock
) -> None:
    try:
        fence = EffectFence(
            FenceConfig(auto_sweep=False, result_ttl=sys.float_info.max),
            store=STORES[store_kind](clock),
        )
    except ValueError:
        return
    t = fence.request("i", "d", "t").ticket
    fence.commit(t, {})  # OverflowError here although the intent is now DONE


# -- 6. decorator: did_not_fire is validated only when an exception is already in flight -----


def test_did_not_fire_with_a_non_type_is_refused_at_decoration(fence: EffectFence) -> None:
    """``did_not_fire=("BankDown",)`` is accepted; when the function raises, ``isinstance``
    raises TypeError inside finish_error, so neither abort nor release runs: the lease is left
    in flight, lapses, and a retry runs the (possibly fired) effect again."""
    try:
        deco = fenced(fence, intent="pay:{n}", domain="d", did_not_fire=("BankDown",))  # type: ignore[arg-type]
    except TypeError:
        return  # fixed

    @deco
    def pay(n: int) -> None:
        raise RuntimeError("socket closed after the request was sent")

    with pytest.raises(BaseException):  # noqa: B017 - any exception; the state is the point
        pay(1)
    assert fence.intent_status("pay:1").state == "failed", "the lease was left behind"


# -- 7. G8: a wheel entry appended to a bucket that a sweep already took is lost -------------


def test_wheel_entry_is_not_lost_when_a_sweep_takes_its_bucket(clock: FakeClock) -> None:
    store = MemoryStore(clock=clock)
    fence = EffectFence(
        FenceConfig(auto_sweep=False, lease_ttl=10.0, lapsed_grace=0.0), store=store
    )
    fence.request("a", "d", "t")  # bucket of t+10 now exists
    wheel = HookedWheel(store._wheel)
    store._wheel = wheel

    def sweeper_runs_while_b_is_preempted() -> None:
        clock.advance(10.0)
        assert store.sweep() == 1  # takes the bucket (reclaims a)

    wheel.hook = sweeper_runs_while_b_is_preempted
    fence.request("b", "d", "t")  # same deadline: appends into the bucket the sweep took
    clock.advance(100.0)
    store.sweep()
    assert store.size()["records"] == 0, "b's lapsed lease is never reclaimed (G8)"


# -- 8. fail-closed: a forged known_clock carries a domain's clock to the JSON-safe edge -------


def test_clock_at_the_edge_is_refused_at_prepare_not_after_the_effect_ran(
    fence: EffectFence, clock: FakeClock
) -> None:
    """Found by review of the C accelerator (both paths had it): agent "a" may name another
    agent's counter at 2**53-1 in its known_clock; the domain's head then carries it, and the
    next prepare by "b" was admitted with b at 2**53: the effect runs, the certificate can't
    encode the clock, commit is refused forever and the lapsed lease is admitted again. A
    later review found the fix (refusing b after its claim) still moved the domain's seq on
    every refusal (G7), and let "a" lock "b" out of the domain: "a"'s request is now the
    one refused, before anything, and "b" is unaffected."""
    before = fence.stats()["prepare"]["invalid_request"]
    for known in (MAX_SAFE_INTEGER, MAX_KNOWN_COUNTER + 1):
        with pytest.raises(InvalidRequest, match="known_clock"):
            fence.request("pay:a", "d", "t", {}, "a", known_clock={"b": known})
    assert fence.intent_status("pay:a").state == "absent"
    assert fence.current("d") == 0 and fence.store.in_flight("d") == 0  # nothing reserved
    assert fence.stats()["prepare"]["invalid_request"] == before + 2
    adm = fence.request("pay:a", "d", "t", {}, "a", known_clock={"b": MAX_KNOWN_COUNTER})
    fence.commit(adm.ticket, {"ok": True})
    clock.advance(10.0)
    b = fence.request("pay:b", "d", "t", {}, "b")  # b's tick stays JSON-safe
    assert b.fresh and b.ticket.vector_clock.to_dict()["b"] == MAX_KNOWN_COUNTER + 1
    fence.commit(b.ticket, {"ok": True})


# -- sound: checked, and holds --------------------------------------------------------------


def test_expected_seq_on_an_evicted_domain_never_matches_an_old_pair(fence: EffectFence) -> None:
    t = fence.request("x", "d", "t").ticket
    fence.commit(t, {})
    assert fence.evict_domain("d") == t.seq
    adm = fence.request("y", "d", "t", expected_seq=fence.current("d"))
    assert adm.fresh and adm.ticket.seq > t.seq
    fence.commit(adm.ticket, {})
    assert fence.evict_domain("d") is not None
    with pytest.raises(Exception) as info:
        fence.request("z", "d", "t", read_set=[("d", t.seq)])
    assert getattr(info.value, "code", None) == "read_set_stale"


def test_request_object_is_not_shared_state(fence: EffectFence) -> None:
    args = {"amt": 5}
    req = EffectRequest("m", "d", "t", args, "a")
    t = fence.prepare(req).ticket
    args["amt"] = 500  # the caller edits its dict after prepare
    cert = fence.commit(t, {})
    assert cert.args == {"amt": 5} and cert.verify()


# -- the library surface (second review) ------------------------------------------------------


def test_the_default_fence_is_made_once_when_threads_first_use_it_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two threads' first functional-API calls each made a default fence, and both were
    admitted for the same intent: the effect ran twice and both commits went through."""
    import contextlib
    import threading

    import effectfence

    monkeypatch.setattr(effectfence, "_default", None)
    made = threading.Barrier(2, timeout=5)

    class Switching(EffectFence):  # a thread switch inside the constructor, forced
        def __init__(self, *args: Any, **kw: Any) -> None:
            with contextlib.suppress(threading.BrokenBarrierError):
                made.wait(timeout=0.5)  # only one thread may ever get here
            super().__init__(*args, **kw)

    monkeypatch.setattr(effectfence, "EffectFence", Switching)
    ran: list[int] = []
    start = threading.Barrier(2, timeout=5)

    def caller() -> None:
        start.wait()
        adm = effectfence.prepare_effect_fence("charge:1", "order:1", "charge", {"cents": 5})
        if adm.fresh:
            ran.append(1)
            effectfence.commit_effect_cert(adm.ticket, {"ok": True})

    threads = [threading.Thread(target=caller) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ran == [1]


def test_a_wake_between_the_waiters_check_and_its_removal_is_no_error() -> None:
    """A waiter leaving ``wait`` checks that its entry is still there, then removes it;
    ``_wake`` (a commit in another thread) pops entries without the waiters' lock. One
    landing between the two made ``wait`` raise a bare KeyError at the duplicate, where
    it should have answered that the intent is no longer in flight."""
    import threading

    fence = EffectFence(FenceConfig(lease_ttl=30))
    ticket = fence.prepare(EffectRequest("i", "d", "t", {})).ticket
    waiter: list[threading.Thread] = []

    class Waiters(dict[str, Any]):
        checks = 0

        def get(self, key: str, default: Any = None) -> Any:
            got = super().get(key, default)
            if threading.current_thread() is waiter[0]:
                Waiters.checks += 1
                if Waiters.checks == 2:  # wait()'s check before it removes its entry
                    committer = threading.Thread(target=fence.commit, args=(ticket, 1))
                    committer.start()  # its _wake pops the entry right here
                    committer.join()
            return got

    fence._waiters = Waiters()
    out: list[Any] = []

    def wait() -> None:
        try:
            out.append(fence.wait("i", 0.01))
        except BaseException as exc:  # the defect was an exception here
            out.append(exc)

    waiter.append(threading.Thread(target=wait))
    waiter[0].start()
    waiter[0].join()
    assert out == [False]  # timed out while still in flight: the commit came after that
    assert fence.wait("i", 0.0) is True  # and the waiters' table is whole


def test_from_url_refusing_a_config_creates_nothing(tmp_path: Any) -> None:
    """``from_url`` opened (and so created) the store before the fence refused the config
    (a clock, which only the memory store takes), and left its connections open."""
    with pytest.raises(ValueError, match=r"config\.clock"):
        EffectFence.from_url(f"sqlite:///{tmp_path}/fence.db", FenceConfig(clock=lambda: 0.0))
    assert list(tmp_path.iterdir()) == []
