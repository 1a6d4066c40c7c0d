"""Apply one named mutant to a copy of the package and show that its killing tests fail.

Each mutant is ``(name, guarantee, file, exact original snippet, replacement, killers)``. The
harness copies ``effectfence/`` (C extension ``.so`` included), ``tests/`` and the pytest
configuration to a temporary directory, replaces the snippet there (the snippet must occur
exactly once: a harness whose snippets no longer exist fails instead of rotting silently),
and runs only the killing tests in a subprocess whose working directory is the copy, so the
mutated package is the one imported, once in each build: compiled (``EFFECTFENCE_COUNTERS=
atomic``) and pure. A mutant is *killed* when, in every build, pytest exits 1 with at least
one of the named tests reported FAILED; an import error or a missing test does not count.
Each rule has one copy (docs/design.md), so a mutant of a Python rule must change the
compiled build's behaviour too: a second copy in C would let it survive there.

Run by ``tests/test_mutants.py``, or by hand::

    python -m tests.mutants.harness            # every mutant, prints the table
    python -m tests.mutants.harness NAME ...   # some of them
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = "effectfence"
STORES = ("memory-atomic", "memory-pure")


@dataclass(frozen=True)
class Mutant:
    name: str
    guarantee: str
    file: str  # relative to the repository root
    original: str
    replacement: str
    killers: tuple[str, ...]
    what: str


def _both(node: str) -> tuple[str, ...]:
    """A node id with a ``{store}`` placeholder, on every memory store."""
    return tuple(node.format(store=s) for s in STORES)


MUTANTS: tuple[Mutant, ...] = (
    # -- the rules, each written once in effectfence/protocol.py ------------------------------
    Mutant(
        "replay-without-payload-check",
        "G4",
        "effectfence/protocol.py",
        "    (Row.DONE_LIVE, False): Action.REFUSE_CONFLICT,",
        "    (Row.DONE_LIVE, False): Action.REPLAY,",
        _both("tests/test_stateful.py::test_state_table_prepare_other_payload[{store}-done-args]"),
        "a duplicate with another payload gets the recorded cert",
    ),
    Mutant(
        "done-not-replayed",
        "G3",
        "effectfence/protocol.py",
        "    (Row.DONE_LIVE, True): Action.REPLAY,",
        "    (Row.DONE_LIVE, True): Action.CLAIM,",
        _both("tests/test_stateful.py::test_state_table_prepare_same_payload[{store}-done]"),
        "a duplicate of a committed intent is not given the cert",
    ),
    Mutant(
        "live-lease-taken-over",
        "G1",
        "effectfence/protocol.py",
        "    (Row.IN_FLIGHT_LIVE, True): Action.REFUSE_IN_FLIGHT,",
        "    (Row.IN_FLIGHT_LIVE, True): Action.TAKEOVER,",
        _both("tests/test_stateful.py::test_state_table_prepare_same_payload[{store}-in_flight]"),
        "a duplicate takes over a live lease: two holders run the effect",
    ),
    Mutant(
        "lapsed-lease-taken-with-other-payload",
        "G4",
        "effectfence/protocol.py",
        "    (Row.IN_FLIGHT_LAPSED, False): Action.REFUSE_CONFLICT,",
        "    (Row.IN_FLIGHT_LAPSED, False): Action.TAKEOVER,",
        _both(
            "tests/test_stateful.py::test_state_table_prepare_other_payload"
            "[{store}-in_flight_lapsed-args]"
        ),
        "another payload may take over a lapsed lease",
    ),
    Mutant(
        "abort-frees-intent",
        "G9",
        "effectfence/protocol.py",
        "    (Row.FAILED, True): Action.REFUSE_FAILED,",
        "    (Row.FAILED, True): Action.REPLAY,",
        _both("tests/test_stateful.py::test_state_table_prepare_same_payload[{store}-failed]"),
        "a failed intent answers duplicates instead of fencing them",
    ),
    Mutant(
        "old-token-allowed",
        "G2",
        "effectfence/protocol.py",
        "    (Row.IN_FLIGHT_LIVE, False): TicketVerdict.LEASE_LOST,",
        "    (Row.IN_FLIGHT_LIVE, False): TicketVerdict.ALLOW,",
        _both("tests/test_stateful.py::test_state_table_old_token_after_takeover[{store}-commit]"),
        "the ticket table lets a superseded token through",
    ),
    Mutant(
        "recommit-any-result",
        "G3",
        "effectfence/protocol.py",
        "    if cert is not None and cert.result_json == result_json:",
        "    if cert is not None:",
        _both(
            "tests/test_one_decider.py::"
            "test_commit_retried_with_another_result_is_lease_lost[{store}]"
        ),
        "a commit retried with another result is told it succeeded",
    ),
    Mutant(
        "recommit-refused",
        "G3",
        "effectfence/protocol.py",
        "    (Row.DONE_LIVE, True): TicketVerdict.COMMITTED,",
        "    (Row.DONE_LIVE, True): TicketVerdict.LEASE_LOST,",
        _both(
            "tests/test_one_decider.py::"
            "test_commit_retried_with_the_same_result_gets_the_same_certificate[{store}]"
        ),
        "the ticket that committed is told lease_lost when it asks again (it did succeed)",
    ),
    Mutant(
        "commit-skips-read-set",
        "G6",
        "effectfence/protocol.py",
        "        others = tuple((d, s) for d, s in read_set if d != domain)\n",
        "        others = ()\n",
        (
            *_both(
                "tests/test_chaos.py::test_interleaved_read_set_moves_while_committing[{store}]"
            ),
            *_both("tests/test_stateful.py::test_read_set_checked_at_prepare_and_commit[{store}]"),
        ),
        "skip read-set re-validation at commit",
    ),
    Mutant(
        "own-seq-not-rechecked",
        "G6",
        "effectfence/protocol.py",
        "    return others, (seq if strict else None)",
        "    return others, None",
        _both("tests/test_chaos.py::test_interleaved_expected_seq_moves_while_committing[{store}]"),
        "expected_seq is not re-validated at commit",
    ),
    Mutant(
        "expected-seq-ignored",
        "G6",
        "effectfence/protocol.py",
        "        return (), expected_seq, None",
        "        return (), None, None",
        _both(
            "tests/test_chaos.py::test_forced_domain_race_exactly_one_winner_every_trial[{store}]"
        ),
        "strict OCC: the compare-exchange becomes a plain reservation",
    ),
    Mutant(
        "read-set-unchecked-at-prepare",
        "G6",
        "effectfence/protocol.py",
        "            others.append((d, s))",
        "            pass",
        _both("tests/test_stateful.py::test_read_set_checked_at_prepare_and_commit[{store}]"),
        "the read set is not compared at prepare",
    ),
    Mutant(
        "own-read-set-entry-not-atomic",
        "G6",
        "effectfence/protocol.py",
        "    return tuple(others), expected_seq if expected_seq is not None else own, None",
        "    return (*others, *([(domain, own)] if own is not None else [])), expected_seq, None",
        tuple(
            "tests/test_regressions.py::"
            f"test_own_domain_read_set_is_checked_atomically_with_the_reservation[{k}]"
            for k in ("atomic", "pure")
        ),
        "a read-set entry on the claim's own domain is compared apart from the reservation",
    ),
    Mutant(
        "sweep-reclaims-lapsed-at-once",
        "G2",
        "effectfence/protocol.py",
        "        return ttl + lapsed_grace",
        "        return ttl",
        _both(
            "tests/test_regressions.py::"
            "test_lapsed_holder_not_taken_over_can_commit_despite_auto_sweep[{store}]"
        ),
        "a lapsed lease its holder could still commit is reclaimed at once",
    ),
    Mutant(
        "sweep-reclaims-failed",
        "G9",
        "effectfence/protocol.py",
        "    return math.inf\n",
        "    return ttl\n",
        _both("tests/test_stateful.py::test_sweep_reclaims_exactly_the_expired[{store}]"),
        "an aborted (unknown) intent is freed by the sweeper",
    ),
    Mutant(
        "result-outlives-ttl",
        "G8",
        "effectfence/protocol.py",
        "        return _DONE_LIVE if now < record.until else _DONE_EXPIRED",
        "        return _DONE_LIVE",
        _both("tests/test_fence.py::test_g1_record_retained_until_result_ttl[{store}]"),
        "a result past its result_ttl is still replayed (and never claimable again)",
    ),
    # -- the decider (effectfence/fence.py) ---------------------------------------------------
    Mutant(
        "fingerprint-ignores-domain",
        "G4",
        "effectfence/fence.py",
        "                    b',\"domain\":',\n                    name_bytes(domain),\n",
        "",
        _both(
            "tests/test_stateful.py::test_state_table_prepare_other_payload[{store}-done-domain]"
        ),
        "the canonical fingerprint leaves out the domain",
    ),
    Mutant(
        "no-auto-sweep",
        "G8",
        "effectfence/fence.py",
        "            if self._auto:\n                if now >= self._sweep_due:",
        "            if False:\n                if now >= self._sweep_due:",
        _both("tests/test_stateful.py::test_auto_sweep_bounds_memory[{store}]"),
        "expired records are only reclaimed when someone calls sweep()",
    ),
    Mutant(
        "no-reaping",
        "G8",
        "effectfence/fence.py",
        "                self.sweep(REAP_BATCH)",
        "                pass",
        _both("tests/test_one_decider.py::test_reclaiming_keeps_pace_at_any_rate[{store}]"),
        "reclaiming runs only on the sweep interval: at high rates memory grows",
    ),
    Mutant(
        "admit-clock-at-edge",
        "G1",
        "effectfence/fence.py",
        "        if seq > MAX_SAFE_INTEGER or counters[agent] > MAX_SAFE_INTEGER:\n",
        "        if seq > MAX_SAFE_INTEGER:\n",
        # the request bound (model.MAX_KNOWN_COUNTER) keeps callers from reaching this
        # backstop; the test poisons a head by hand, as a store written before the bound
        _both(
            "tests/test_fence.py::test_a_poisoned_head_is_still_refused_before_the_effect_runs[{store}]"
        ),
        "a ticket whose clock a certificate cannot encode is admitted: it runs, never commits",
    ),
    Mutant(
        "commit-ignores-ticket-verdict",
        "G2",
        "effectfence/fence.py",
        "        if verdict is not _ALLOW:  # COMMITTED too: this is not a commit\n",
        "        if False:\n",
        _both("tests/test_stateful.py::test_state_table_ticket_ops[{store}-absent-release]"),
        "abort, release and renew skip the judge and rely on the store alone",
    ),
    Mutant(
        "commit-judges-a-refusal-without-the-table",
        "G3",
        "effectfence/fence.py",
        "        if verdict is _COMMITTED and found is not None and found.fingerprint == fp:\n",
        "        if found is not None and found.state is State.DONE and found.fingerprint == fp:\n",
        _both(
            "tests/test_one_decider.py::"
            "test_commit_retried_after_its_result_expired_is_lease_lost[{store}]"
        ),
        "a commit retried after its result expired learns a certificate the table calls lost",
    ),
    # -- the store's compare-and-set steps (effectfence/store/memory.py) ----------------------
    Mutant(
        "commit-without-token-check",
        "G2",
        "effectfence/store/memory.py",
        "                or cur.state is not _IN_FLIGHT\n"
        "                or cur.token != token\n"
        "                or cur.fingerprint != fingerprint\n",
        "                or cur.state is not _IN_FLIGHT\n"
        "                or cur.fingerprint != fingerprint\n",
        _both(
            "tests/test_chaos.py::test_interleaved_takeover_fences_the_old_ticket[{store}-complete]"
        ),
        "drop the token comparison of the complete step",
    ),
    Mutant(
        "commit-without-payload-check",
        "G4",
        "effectfence/store/memory.py",
        "                or cur.token != token\n"
        "                or cur.fingerprint != fingerprint\n",
        "                or cur.token != token\n",
        _both(
            "tests/test_one_decider.py::"
            "test_a_commit_with_a_ticket_altered_since_admission_is_refused[{store}]"
        ),
        "the complete step ignores the ticket's payload: a ticket altered since admission "
        "commits a certificate for an action nobody admitted",
    ),
    Mutant(
        "release-by-key",
        "G7",
        "effectfence/store/memory.py",
        "        return self._finish(intent, token, lambda cur: None)",
        "        with self._locks[self._stripe(intent)]:\n"
        "            cur = self._records.pop(intent, None)\n"
        "        return Step(APPLIED if cur is not None else MOVED, None, cur)",
        _both(
            "tests/test_chaos.py::test_interleaved_takeover_fences_the_old_ticket[{store}-release]"
        ),
        "release deletes the record by key, not compare-and-delete by token",
    ),
    Mutant(
        "claim-overwrites-live-record",
        "G1",
        "effectfence/store/memory.py",
        "            if cur is not expect:\n",
        "            if False:\n",
        _both("tests/test_chaos.py::test_interleaved_duplicate_claim_admits_exactly_one[{store}]"),
        "the claim step does not compare the slot with the record the decider observed",
    ),
    Mutant(
        "takeover-keeps-old-token",
        "G2",
        "effectfence/store/memory.py",
        "            token = self._tokens.reserve_slot(self._token_slot)\n"
        "            lease_until = now + lease_ttl\n",
        "            token = (\n"
        "                cur.token\n"
        "                if cur is not None and cur.state is _IN_FLIGHT\n"
        "                else self._tokens.reserve_slot(self._token_slot)\n"
        "            )\n"
        "            lease_until = now + lease_ttl\n",
        (
            *_both(
                "tests/test_stateful.py::test_state_table_old_token_after_takeover[{store}-commit]"
            ),
            *_both(
                "tests/test_chaos.py::test_interleaved_takeover_between_takeover_and_claim[{store}]"
            ),
        ),
        "a takeover keeps the old token: the old ticket is not fenced",
    ),
    Mutant(
        "evict-while-in-flight",
        "G5",
        "effectfence/store/memory.py",
        "            busy = self.in_flight(domain)\n            if busy:",
        "            busy = self.in_flight(domain)\n            if False:",
        _both("tests/test_stateful.py::test_evict_refused_while_in_flight[{store}]"),
        "evict_domain does not check for attempts in flight",
    ),
    Mutant(
        "store-reserve-ignores-cas",
        "G6",
        "effectfence/store/memory.py",
        "            if reserve_at is None:\n                seq = seqs.reserve(domain)",
        "            if True:\n                seq = seqs.reserve(domain)",
        _both(
            "tests/test_chaos.py::test_forced_domain_race_exactly_one_winner_every_trial[{store}]"
        ),
        "the claim step reserves the next seq whatever seq it was told to compare",
    ),
    Mutant(
        "lost-race-creates-domain",
        "G7",
        "effectfence/store/memory.py",
        "                if seqs.find(domain) < 0:",
        "                if False:",
        _both("tests/test_stateful.py::test_refused_prepares_leave_no_trace[{store}]"),
        "a prepare refused domain_race leaves a new domain behind",
    ),
    Mutant(
        "sweep-ignores-deadline",
        "G8",
        "effectfence/store/memory.py",
        "                    if cur is None or cur.token != token or cur.reclaim_at > now:",
        "                    if cur is None or cur.token != token:",
        _both("tests/test_stateful.py::test_sweep_reclaims_exactly_the_expired[{store}]"),
        "sweep deletes whatever a due wheel entry points at, even a renewed lease",
    ),
    # -- counters, certificates, the C constructor ---------------------------------------------
    Mutant(
        "evict-resets-to-zero-pure",
        "G5",
        "effectfence/counters.py",
        "            self._floor = max(self._floor, min(last + 1, MAX_VALUE))",
        "            self._floor = 0",
        ("tests/test_stateful.py::test_evict_never_reissues_a_seq[memory-pure]",),
        "reset a domain to 0 on evict (pure table: the floor is not raised)",
    ),
    Mutant(
        "evict-resets-to-zero-atomic",
        "G5",
        "effectfence/counters.py",
        "            fresh = _take_slot(_a_load(self._floor_slot))",
        "            fresh = _take_slot(0)",
        ("tests/test_stateful.py::test_evict_never_reissues_a_seq[memory-atomic]",),
        "reset a domain to 0 on evict (atomic table: a re-created counter starts at 0)",
    ),
    Mutant(
        "verify-trusts-hash",
        "G10",
        "effectfence/cert.py",
        "            return self.compute_hash() == self.hash",
        "            return len(self.hash) == 64",
        _both("tests/test_stateful.py::test_replayed_cert_is_tamper_evident[{store}]"),
        "verify() does not recompute the hash",
    ),
    Mutant(
        "replay-shares-result-object",
        "G3",
        "effectfence/cert.py",
        "        return json_loads(self[6])\n",
        '        return globals().setdefault("_shared", {}).setdefault(self[10], json_loads(self[6]))\n',  # noqa: E501
        _both(
            "tests/test_regressions.py::"
            "test_mutating_a_replayed_result_does_not_change_the_recorded_certificate[{store}]"
        ),
        "replays hand out one shared result object that a caller can edit",
    ),
    Mutant(
        "c-request-skips-name-checks",
        "G7",
        "csrc/effectfence_speedups.c",
        "    return len > 0 && len <= max_name && memchr(",
        "    return len <= max_name && memchr(",
        ("tests/test_speedups.py::test_request_init_in_c_refuses_what_python_refuses[call0]",),
        "the C request constructor accepts an empty name the Python one refuses",
    ),
    # -- the C memory store's compare-and-set steps (csrc/effectfence_memstore.c): mechanics,
    # not rules, but a store that skips a compare breaks the guarantee the rule relies on.
    Mutant(
        "c-store-claim-ignores-observed-record",
        "G1",
        "csrc/effectfence_memstore.c",
        "    if (curp != a[C_EXPECT]) {",
        "    if (0 && curp != a[C_EXPECT]) {",
        (
            "tests/test_store_contract.py::test_claim_expect_none_on_existing_record_is_moved"
            "[memory-c]",
            "tests/test_store_contract.py::test_threads_racing_one_intent_exactly_one_fresh"
            "[memory-c]",
        ),
        "a claim installs over a record the decider never saw: two holders",
    ),
    Mutant(
        "c-store-complete-ignores-token",
        "G2",
        "csrc/effectfence_memstore.c",
        "        moved = PyObject_RichCompareBool(f_token, token, Py_NE);",
        "        moved = 0;",
        ("tests/test_store_contract.py::test_complete_is_compare_by_token[memory-c-wrong_token]",),
        "a superseded holder's commit overwrites the current holder's record",
    ),
    Mutant(
        "c-store-complete-ignores-payload",
        "G4",
        "csrc/effectfence_memstore.c",
        "        moved = PyObject_RichCompareBool(fp, a[K_FP], Py_NE);",
        "        moved = 0;",
        (
            "tests/test_store_contract.py::test_complete_is_compare_by_token[memory-c-wrong_payload]",
        ),
        "a ticket altered since admission commits a certificate for an unadmitted payload",
    ),
    Mutant(
        "c-store-claim-ignores-read-set",
        "G6",
        "csrc/effectfence_memstore.c",
        "    if (has_compare) {\n        stale = compare_pairs(c, a[C_COMPARE]);",
        "    if (0) {\n        stale = compare_pairs(c, a[C_COMPARE]);",
        ("tests/test_store_contract.py::test_claim_compare_stale_writes_nothing[memory-c]",),
        "a claim whose read set moved is admitted",
    ),
    Mutant(
        "c-store-complete-ignores-own-seq",
        "G6",
        "csrc/effectfence_memstore.c",
        "    if (stale == Py_None && a[K_OWN_SEQ] != Py_None) {",
        "    if (0) {",
        (
            "tests/test_store_contract.py::test_complete_own_seq_judged_against_the_domain"
            "[memory-c]",
        ),
        "a commit whose own domain moved while the effect ran is recorded as done",
    ),
)


def copy_tree(dest: Path) -> Path:
    """The package (with its compiled extension), the tests, the C sources and the pytest
    configuration."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.o", ".hypothesis")
    shutil.copytree(ROOT / PKG, dest / PKG, ignore=ignore)
    shutil.copytree(ROOT / "tests", dest / "tests", ignore=ignore)
    shutil.copytree(ROOT / "csrc", dest / "csrc", ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


_BUILD_EXTENSION = (
    "import sys\n"
    "from setuptools import Extension, setup\n"
    "setup(name='mutant', script_args=['-q', 'build_ext', '--inplace'], ext_modules=[Extension("
    "sys.argv[1], [sys.argv[2]], extra_compile_args=['-std=c11', '-O2'])])\n"
)


def extension_of(source: str) -> str:
    """The module a C source builds, as setup.py names it (csrc/effectfence_X.c: ._X)."""
    stem = Path(source).stem
    if Path(source).parent.name != "csrc" or not stem.startswith("effectfence_"):
        raise AssertionError(f"{source}: not one of the package's C extensions")
    return f"{PKG}._{stem.removeprefix('effectfence_')}"


def rebuild_extension(tree: Path, source: str) -> None:
    """Compile the tree's (mutated) extension over the copied one, as setup.py would."""
    subprocess.run(
        [sys.executable, "-c", _BUILD_EXTENSION, extension_of(source), source],
        cwd=tree,
        env=_env(tree),
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )


def apply(mutant: Mutant, tree: Path) -> None:
    path = tree / mutant.file
    text = path.read_text()
    n = text.count(mutant.original)
    if n != 1:
        raise AssertionError(f"{mutant.name}: snippet found {n} times in {mutant.file}")
    path.write_text(text.replace(mutant.original, mutant.replacement))


def check_snippets(root: Path = ROOT) -> list[str]:
    """Problems with the table against the current source (empty when all is well)."""
    problems = []
    for m in MUTANTS:
        text = (root / m.file).read_text()
        n = text.count(m.original)
        if n != 1:
            problems.append(f"{m.name}: original snippet occurs {n} times in {m.file}")
        if m.original == m.replacement:
            problems.append(f"{m.name}: replacement equals the original")
    names = [m.name for m in MUTANTS]
    if len(set(names)) != len(names):
        problems.append("mutant names are not unique")
    return problems


#: The two builds every mutant is tried against: the compiled core (C counters and the
#: accelerator) and the pure-Python twin. A rule has one copy, so a mutant of it must be
#: killed in both: a second copy in C would show up here as a survivor in the compiled build.
BUILDS = ("atomic", "pure")
#: killer ids that exist only in the compiled build (the atomic table's parametrizations)
_COMPILED_ONLY = ("[memory-atomic", "[memory-c", "[atomic]", "test_speedups.py")


def _env(tree: Path, build: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["EFFECTFENCE_DERANDOMIZE"] = "1"
    env.pop("EFFECTFENCE_COUNTERS", None)
    if build is not None:
        env["EFFECTFENCE_COUNTERS"] = build
    return env


def compiled_available() -> bool:
    """Whether this checkout has the compiled core to test mutants against."""
    pkg = ROOT / PKG
    return bool(list(pkg.glob("_effectfence_atomic*.so"))) and bool(list(pkg.glob("_speedups*.so")))


def killers_in(build: str, ids: tuple[str, ...]) -> tuple[str, ...]:
    """The test ids of ``ids`` that exist in ``build``."""
    if build == "pure":
        return tuple(k for k in ids if not any(c in k for c in _COMPILED_ONLY))
    return ids


def builds_for(mutant: Mutant) -> dict[str, tuple[str, ...]]:
    """build -> the killers that run in it. C mutants have only the compiled build."""
    out: dict[str, tuple[str, ...]] = {}
    for build in BUILDS:
        if build == "atomic" and not compiled_available():
            continue
        if build == "pure" and mutant.file.endswith(".c"):
            continue
        ids = killers_in(build, mutant.killers)
        if ids:
            out[build] = ids
    return out


def which_package(tree: Path) -> str:
    """The file ``import effectfence`` resolves to when run the way the tests are run."""
    out = subprocess.run(
        [sys.executable, "-c", f"import {PKG}; print({PKG}.__file__)"],
        cwd=tree,
        env=_env(tree),
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


@dataclass(frozen=True)
class Outcome:
    rc: int
    failed: tuple[str, ...]
    output: str


def run_tests(
    tree: Path, nodeids: tuple[str, ...], timeout: float = 240.0, build: str | None = None
) -> Outcome:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-rf"]
    proc = subprocess.run(
        [*cmd, *nodeids],
        cwd=tree,
        env=_env(tree, build),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    failed = tuple(re.findall(r"^FAILED (\S+)", out, flags=re.M))
    return Outcome(proc.returncode, failed, out)


def killed(mutant: Mutant, outcome: Outcome) -> bool:
    """Killed in every build it was tried in (each run's failures prefixed by its build)."""
    if outcome.rc != 1 or not outcome.failed:
        return False
    per_build: dict[str, bool] = {}
    for f in outcome.failed:
        build, _, node = f.partition(":")
        per_build[build] = per_build.get(build, False) or node in mutant.killers
    return set(per_build) == set(builds_for(mutant)) and all(per_build.values())


def run_mutant(mutant: Mutant) -> tuple[Mutant, Outcome]:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        tree = copy_tree(Path(tmp))
        try:
            apply(mutant, tree)
            if mutant.file.endswith(".c"):
                rebuild_extension(tree, mutant.file)
        except AssertionError as exc:  # reported as a survivor, with the reason
            return mutant, Outcome(-1, (), str(exc))
        except subprocess.CalledProcessError as exc:  # a mutant that does not compile
            return mutant, Outcome(-1, (), f"rebuild failed:\n{exc.stdout}\n{exc.stderr}")
        failed: list[str] = []
        outputs: list[str] = []
        rc = 1
        for build, ids in builds_for(mutant).items():
            out = run_tests(tree, ids, build=build)
            outputs.append(f"--- {build} build ---\n{out.output}")
            if out.rc != 1:
                rc = out.rc  # survived (0) or broke (2+) in this build
            failed.extend(f"{build}:{f}" for f in out.failed if f in ids)
        return mutant, Outcome(rc, tuple(failed), "\n".join(outputs))


def all_killers() -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for m in MUTANTS:
        for k in m.killers:
            seen[k] = None
    return tuple(seen)


def table_rows() -> str:
    """The table of MUTANTS.md, from MUTANTS (``python -m tests.mutants.harness --doc``)."""
    rows = ["| mutant | guarantee | file | what it breaks | killed by |", "|---|---|---|---|---|"]
    for m in MUTANTS:
        killers = "<br>".join(f"`{k}`" for k in m.killers)
        rows.append(f"| `{m.name}` | {m.guarantee} | `{m.file}` | {m.what} | {killers} |")
    return "\n".join(rows) + "\n"


DOC = Path(__file__).with_name("MUTANTS.md")


def write_doc(path: Path = DOC) -> None:
    text = path.read_text()
    head = text[: text.index("| mutant | guarantee |")]
    path.write_text(head + table_rows())


def main(argv: list[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv)
    if names == ["--doc"]:
        write_doc()
        return 0
    chosen = [m for m in MUTANTS if not names or m.name in names]
    problems = check_snippets()
    if problems:
        print("\n".join(problems))
        return 2
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        results = list(pool.map(run_mutant, chosen))
    survivors = 0
    for m, out in results:
        ok = killed(m, out)
        survivors += not ok
        first = out.failed[0] if out.failed else "-"
        print(f"{'KILLED ' if ok else 'SURVIVED'} {m.guarantee:4} {m.name:40} {first}")
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
