"""Chaos with real OS threads, and check-then-act races pinned open on purpose.

Two kinds of tests live here, both on every store in ``support.STORES``:

- *Forced collisions*: real OS threads, built and parked behind a ``threading.Barrier`` and
  released together, so the collision is guaranteed, not hoped for; most run with CPython's
  switch interval at a microsecond (``support.preemptive``) so they interleave inside calls.
  Executions are counted at an independent sink (a counter the effect itself increments),
  never from the fence's stats.
- *Forced interleavings*: CPython's GIL makes a thread rarely lose the CPU inside the few
  microseconds between the fence's observation and the store's conditional step, so a
  missing compare-by-token could survive any number of thread races. ``HookedStore`` runs the
  competing operation exactly inside that window, deterministically.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

import pytest
from support import STORES, FakeClock, FenceFactory, HookedStore, preemptive, race

from effectfence import (
    DomainRace,
    EffectCert,
    EffectFence,
    EffectRequest,
    FenceConfig,
    IntentFailed,
    IntentInFlight,
    LeaseLost,
    ReadSetStale,
    Refusal,
    Replay,
)
from effectfence.model import PreparedEffect


class Sink:
    """The world outside the fence: counts how many times the effect really ran."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.by_intent: dict[str, int] = {}

    def fire(self, intent: str) -> None:
        with self._lock:
            self.count += 1
            self.by_intent[intent] = self.by_intent.get(intent, 0) + 1


def req(
    intent: str = "charge:order-777",
    domain: str = "order:777",
    agent: str = "agent",
    args: dict[str, Any] | None = None,
    **kw: Any,
) -> EffectRequest:
    return EffectRequest(
        intent, domain, "charge", {"cents": 77700} if args is None else args, agent, **kw
    )


def hooked(store_kind: str, clock: FakeClock, **config: Any) -> tuple[EffectFence, HookedStore]:
    config.setdefault("auto_sweep", False)
    config.setdefault("lease_ttl", 10.0)
    config.setdefault("result_ttl", 100.0)
    store = HookedStore(STORES[store_kind](clock))
    return EffectFence(FenceConfig(**config), store=store), store


# -- forced same-instant domain race -----------------------------------------------------------


def test_forced_domain_race_exactly_one_winner_every_trial(fence: EffectFence) -> None:
    """N threads, one expected seq, released by a Barrier: one winner in every trial."""
    n, trials = 8, 120
    winners_per_trial: list[int] = []
    for trial in range(trials):
        domain = f"acct:{trial % 3}"  # domains are reused: later trials race on moved counters
        base = fence.current(domain)
        size_before = fence.store.size()["records"]

        def go(i: int, trial: int = trial, domain: str = domain, base: int = base) -> int:
            adm = fence.prepare(req(f"t{trial}-{i}", domain, f"a{i}", expected_seq=base))
            assert adm.fresh
            return adm.ticket.seq

        with preemptive():
            outcomes = race(n, go)
        wins = [o for o in outcomes if isinstance(o, int)]
        losses = [o for o in outcomes if isinstance(o, DomainRace)]
        assert len(outcomes) == n
        assert wins == [base + 1], (trial, outcomes)
        assert len(losses) == n - 1, (trial, outcomes)
        assert all(e.details["actual"] == base + 1 for e in losses)
        # the domain moved by exactly one; losers left no record behind (G7)
        assert fence.current(domain) == base + 1
        assert fence.store.size()["records"] == size_before + 1
        winners_per_trial.append(len(wins))
    assert winners_per_trial == [1] * trials
    assert fence.stats()["prepare"]["domain_race"] == trials * (n - 1)


# -- 16 concurrent duplicates ---------------------------------------------------------------------


def _duplicates_trial(fence: EffectFence, sink: Sink, intent: str, n: int) -> None:
    committed: list[EffectCert] = []
    after_commit = threading.Barrier(n)
    outcomes: list[Any] = [None] * n

    def attempt(i: int) -> None:
        try:
            adm = fence.prepare(req(intent, agent=f"agent-{i}"))
            if adm.fresh:
                sink.fire(intent)  # the effect runs here, and only here
                committed.append(fence.commit(adm.ticket, {"charge_id": f"ch_{intent}"}))
                outcomes[i] = "executed"
            else:
                outcomes[i] = adm.cert
        except IntentInFlight:
            outcomes[i] = "in_flight"
        after_commit.wait()
        if outcomes[i] == "in_flight":  # a late duplicate retries after the commit
            outcomes[i] = fence.prepare(req(intent, agent=f"agent-{i}"))

    with preemptive():
        race(n, attempt)
    assert sink.by_intent[intent] == 1, outcomes
    assert len(committed) == 1
    cert = committed[0]
    assert outcomes.count("executed") == 1
    for o in outcomes:
        if o == "executed":
            continue
        got = o.cert if isinstance(o, Replay) else o
        assert isinstance(got, EffectCert), o
        assert got.hash == cert.hash and got.verify()
    # and a fresh wave of n late duplicates, all concurrent, all replay the same cert
    late = race(n, lambda i: fence.prepare(req(intent, agent=f"late-{i}")))
    assert all(isinstance(r, Replay) and r.cert.hash == cert.hash for r in late), late
    assert all(r.cert.verify() for r in late if isinstance(r, Replay))


def test_sixteen_duplicates_one_execution_late_ones_replay(fence: EffectFence) -> None:
    n, trials = 16, 40
    sink = Sink()
    for trial in range(trials):
        _duplicates_trial(fence, sink, f"charge:dup-{trial}", n)
    assert sink.count == trials


# -- 32 threads of distinct intents on one domain ---------------------------------------------


def test_thirty_two_threads_distinct_intents_seqs_never_reused(fence: EffectFence) -> None:
    n, per_thread = 32, 30
    domain = "ledger:1"
    start = fence.current(domain)

    def worker(i: int) -> list[int]:
        mine: list[int] = []
        for j in range(per_thread):
            intent = f"w{i}-{j}"
            kw: dict[str, Any] = {}
            if j % 5 == 4:  # strict OCC attempts mixed in: a loss must allocate nothing
                kw["expected_seq"] = fence.current(domain)
            try:
                t = fence.prepare(req(intent, domain, f"a{i}", **kw)).ticket
            except DomainRace:
                continue
            mine.append(t.seq)
            if j % 3 == 0:
                try:
                    assert fence.commit(t, j).seq == t.seq
                except ReadSetStale:  # strict OCC: the domain moved on while "it ran" (G6)
                    assert "expected_seq" in kw
            elif j % 3 == 1:
                fence.release(t)
            else:
                fence.abort(t, "unknown")
        return mine

    with preemptive():
        outcomes = race(n, worker)
    assert all(isinstance(o, list) for o in outcomes), [
        o for o in outcomes if not isinstance(o, list)
    ]
    per: list[list[int]] = [o for o in outcomes if isinstance(o, list)]
    for mine in per:  # each thread saw its own reservations strictly increase
        assert all(a < b for a, b in itertools.pairwise(mine)), mine
    seqs = [s for mine in per for s in mine]
    assert len(seqs) == len(set(seqs)), "a sequence number was handed out twice"
    assert sorted(seqs) == list(range(start + 1, start + 1 + len(seqs))), "gap or reuse"
    assert fence.current(domain) == start + len(seqs)
    assert len(seqs) >= n * per_thread * 4 // 5  # only strict attempts can lose


# -- storms -------------------------------------------------------------------------------------


def storm_once(fence: EffectFence, run: int, waves: int, racers: int) -> dict[str, int]:
    """``waves * racers`` attempts at one intent from a pool of racers released per wave.

    The executing attempt commits, or (every third run) first gives up once without firing
    (``release``), so later waves must retry and one of them executes. Every attempt that is
    refused in flight comes back in the next wave: late retries of a live intent.
    """
    sink = Sink()
    intent = f"charge:storm-{run}"
    barrier = threading.Barrier(racers)
    tally = {"fresh": 0, "replay": 0, "in_flight": 0, "released": 0, "errors": 0}
    lock = threading.Lock()
    give_up_first = run % 3 == 2
    gave_up = threading.Event()

    def note(k: str) -> None:
        with lock:
            tally[k] += 1

    def racer(i: int) -> None:
        for w in range(waves):
            barrier.wait()
            try:
                adm = fence.prepare(req(intent, agent=f"agent-{w}-{i}"))
            except IntentInFlight:
                note("in_flight")
                continue
            except BaseException:
                note("errors")
                raise
            if not adm.fresh:
                note("replay")
                assert adm.cert.verify()
                continue
            note("fresh")
            if give_up_first and not gave_up.is_set():
                gave_up.set()
                fence.release(adm.ticket)  # definitely did not fire: a retry may run
                note("released")
                continue
            sink.fire(intent)
            fence.commit(adm.ticket, {"charged": 77700})

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(racers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"executions": sink.count, **tally}


def test_storm_thousand_attempts_many_runs_exactly_one_execution(fence: EffectFence) -> None:
    waves, racers, runs = 40, 25, 24
    for run in range(runs):
        with preemptive(1e-5 if run % 2 else 5e-3):  # odd runs: switch threads very often
            out = storm_once(fence, run, waves, racers)
        attempts = out["replay"] + out["in_flight"] + out["fresh"]
        assert out["errors"] == 0, out
        assert attempts == waves * racers == 1000, out
        assert out["executions"] == 1, (run, out)  # counted at the sink, not the fence
        assert out["fresh"] == 1 + out["released"], out
        cert = fence.prepare(req(f"charge:storm-{run}", agent="auditor"))
        assert isinstance(cert, Replay) and cert.cert.verify()


def _zombie_trial(fence: EffectFence, clock: FakeClock, intent: str, n: int) -> bool:
    old = fence.prepare(req(intent, agent="zombie")).ticket
    clock.advance(10.0)  # the lease ends at its deadline: takeover is now allowed
    commits: list[EffectCert] = []
    lock = threading.Lock()

    def go(i: int) -> str:
        if i == 0:
            try:
                c = fence.commit(old, "zombie")
            except LeaseLost:
                return "fenced"
            with lock:
                commits.append(c)
            return "committed"
        adm = fence.prepare(req(intent, agent=f"taker-{i}"))
        if not adm.fresh:
            return "replay"
        c = fence.commit(adm.ticket, f"taker-{i}")
        with lock:
            commits.append(c)
        return "took_over"

    with preemptive():
        outcomes = race(n, go)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert all(isinstance(e, IntentInFlight) for e in errors), outcomes
    assert len(commits) == 1, outcomes
    if outcomes[0] == "committed":
        assert "took_over" not in outcomes
    else:
        assert outcomes[0] == "fenced" and outcomes.count("took_over") == 1
    replay = fence.prepare(req(intent, agent="auditor"))
    assert isinstance(replay, Replay) and replay.cert.hash == commits[0].hash
    return outcomes[0] == "committed"


def test_zombie_commit_races_takeovers(fence: EffectFence, clock: FakeClock) -> None:
    """A lapsed holder wakes up and commits at the same instant N others try to take over.

    Whoever wins, the intent ends with exactly one committed effect: either the zombie's
    commit lands first (everyone else replays it) or one taker wins and the zombie is fenced.
    """
    trials = 60
    zombie_won = sum(_zombie_trial(fence, clock, f"charge:zombie-{t}", 8) for t in range(trials))
    assert 0 <= zombie_won <= trials


# -- forced interleavings: the window between observe and act -------------------------------------


def test_interleaved_duplicate_claim_admits_exactly_one(store_kind: str, clock: FakeClock) -> None:
    """B claims between A's observation (absent) and A's claim: A must not overwrite B."""
    fence, store = hooked(store_kind, clock)
    sink = Sink()
    inner: list[Any] = []
    store.before("claim", lambda: inner.append(fence.prepare(req(agent="B"))))
    with pytest.raises(IntentInFlight) as ei:
        fence.prepare(req(agent="A"))
    assert len(inner) == 1 and inner[0].fresh
    assert ei.value.holder == "B"
    ticket = inner[0].ticket
    sink.fire(ticket.intent)
    cert = fence.commit(ticket, "B charged")
    assert sink.count == 1
    again = fence.prepare(req(agent="A"))
    assert isinstance(again, Replay) and again.cert.hash == cert.hash


def test_interleaved_takeover_between_takeover_and_claim(store_kind: str, clock: FakeClock) -> None:
    """Two takers observe the same lapsed lease; only the first takeover may land."""
    fence, store = hooked(store_kind, clock)
    old = fence.prepare(req(agent="zombie")).ticket
    clock.advance(10.0)
    inner: list[Any] = []
    store.before("claim", lambda: inner.append(fence.prepare(req(agent="B"))))
    with pytest.raises(IntentInFlight):
        fence.prepare(req(agent="A"))
    b = inner[0].ticket
    assert inner[0].takeover and b.token > old.token
    rec = fence.store.get(b.intent)
    assert rec is not None and rec.token == b.token and rec.agent == "B"


def _take_over(fence: EffectFence, clock: FakeClock, out: list[PreparedEffect]) -> None:
    clock.advance(10.0)  # A's lease lapses only now, after A's ticket was checked
    adm = fence.prepare(req(agent="B"))
    assert adm.fresh and adm.takeover
    out.append(adm.ticket)


@pytest.mark.parametrize("op", ["complete", "release", "fail", "renew"])
def test_interleaved_takeover_fences_the_old_ticket(
    store_kind: str, clock: FakeClock, op: str
) -> None:
    """A's ticket passes the fence's check; B takes over; only then A's step reaches the store.

    The store's own compare-by-token must refuse A, and B's record must be untouched (G2, G7).
    """
    fence, store = hooked(store_kind, clock)
    a = fence.prepare(req(agent="A")).ticket
    taken: list[PreparedEffect] = []
    store.before(op, lambda: _take_over(fence, clock, taken))
    call = {
        "complete": lambda: fence.commit(a, "A charged"),
        "release": lambda: fence.release(a),
        "fail": lambda: fence.abort(a, "A lost track"),
        "renew": lambda: fence.renew(a),
    }[op]
    with pytest.raises(LeaseLost):
        call()
    assert len(taken) == 1
    b = taken[0]
    rec = fence.store.get(b.intent)
    assert rec is not None and rec.token == b.token and rec.agent == "B"
    assert rec.state.name == "IN_FLIGHT" and rec.lease_until == b.lease_until
    cert = fence.commit(b, "B charged")
    assert cert.agent == "B"
    replay = fence.prepare(req(agent="C"))
    assert isinstance(replay, Replay) and replay.cert.hash == cert.hash


def test_interleaved_read_set_moves_while_committing(store_kind: str, clock: FakeClock) -> None:
    """The read-set domain moves after A's ticket check, before A's commit step: stale."""
    fence, store = hooked(store_kind, clock)
    at = fence.current("inventory:9")
    a = fence.prepare(req(read_set=[("inventory:9", at)])).ticket

    def move() -> None:
        t = fence.prepare(req("restock", "inventory:9", "B")).ticket
        fence.commit(t, "moved")

    store.before("complete", move)
    with pytest.raises(ReadSetStale):
        fence.commit(a, "ran on a stale view")
    with pytest.raises(IntentFailed):
        fence.prepare(req(agent="C"))


def test_interleaved_expected_seq_moves_while_committing(store_kind: str, clock: FakeClock) -> None:
    """Strict OCC is judged at commit too, against the ticket's own reservation."""
    fence, store = hooked(store_kind, clock)
    base = fence.current("order:777")
    a = fence.prepare(req(expected_seq=base)).ticket
    assert a.seq == base + 1
    store.before("complete", lambda: fence.prepare(req("other", agent="B")))
    with pytest.raises(ReadSetStale):
        fence.commit(a, "late")
    assert fence.intent_status(a.intent).state == "failed"


def test_refusals_under_contention_are_typed(fence: EffectFence) -> None:
    """Whatever a racer gets back is a fresh ticket, a replay or a typed refusal: never None."""
    outcomes = race(16, lambda i: fence.prepare(req("x", agent=f"a{i}")))
    for o in outcomes:
        assert isinstance(o, Replay | Refusal) or getattr(o, "fresh", False), o


def test_small_storm_sink_agrees_with_stats(make_fence: FenceFactory) -> None:
    """The sink is the judge; the fence's own count of commits must agree with it."""
    fence = make_fence(lease_ttl=10.0, result_ttl=100.0)
    out = storm_once(fence, 0, waves=4, racers=5)
    assert out["executions"] == 1
    assert fence.stats()["commits"] == 1
