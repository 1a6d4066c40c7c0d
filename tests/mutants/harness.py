"""Apply one named mutant to a copy of the package and show that its killing tests fail.

Each mutant is ``(name, guarantee, file, exact original snippet, replacement, killers)``. The
harness copies ``effectfence/`` (C extension ``.so`` included), ``tests/`` and the pytest
configuration to a temporary directory, replaces the snippet there (the snippet must occur
exactly once: a harness whose snippets no longer exist fails instead of rotting silently),
and runs only the killing tests in a subprocess whose working directory is the copy, so the
mutated package is the one imported. A mutant is *killed* when pytest exits 1 with at least
one of the named tests reported FAILED; an import error or a missing test does not count.

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
    # -- the six named in the issue ---------------------------------------------------------
    Mutant(
        "commit-without-token-check",
        "G2",
        "effectfence/store/memory.py",
        "            if cur is None or cur.state is not _IN_FLIGHT or cur.token != token:\n"
        "                return CommitResult(False, current=cur)",
        "            if cur is None or cur.state is not _IN_FLIGHT:\n"
        "                return CommitResult(False, current=cur)",
        _both(
            "tests/test_chaos.py::test_interleaved_takeover_fences_the_old_ticket[{store}-complete]"
        ),
        "drop the token comparison at commit (store step)",
    ),
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
        "release-by-key",
        "G7",
        "effectfence/store/memory.py",
        "    def release(self, intent: str, token: int) -> tuple[bool, IntentRecord | None]:\n"
        "        return self._finish(intent, token, None)",
        "    def release(self, intent: str, token: int) -> tuple[bool, IntentRecord | None]:\n"
        "        with self._lock(intent):\n"
        "            cur = self._records.pop(intent, None)\n"
        "        return cur is not None, cur",
        _both(
            "tests/test_chaos.py::test_interleaved_takeover_fences_the_old_ticket[{store}-release]"
        ),
        "release deletes the record by key, not compare-and-delete by token",
    ),
    Mutant(
        "commit-skips-read-set",
        "G6",
        "effectfence/fence.py",
        "            ticket.intent, ticket.token, cert, until, read_set=others, own_seq=own_seq",
        "            ticket.intent, ticket.token, cert, until, read_set=(), own_seq=own_seq",
        (
            *_both(
                "tests/test_chaos.py::test_interleaved_read_set_moves_while_committing[{store}]"
            ),
            *_both("tests/test_stateful.py::test_read_set_checked_at_prepare_and_commit[{store}]"),
        ),
        "skip read-set re-validation at commit",
    ),
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
        "takeover-keeps-old-token",
        "G2",
        "effectfence/store/memory.py",
        "            token = self._tokens.reserve_slot(self._token_slot)\n",
        "            token = (\n"
        "                cur.token\n"
        "                if takeover and cur is not None\n"
        "                else self._tokens.reserve_slot(self._token_slot)\n"
        "            )\n",
        (
            *_both(
                "tests/test_stateful.py::test_state_table_old_token_after_takeover[{store}-commit]"
            ),
            *_both(
                "tests/test_chaos.py::test_interleaved_takeover_between_takeover_and_claim[{store}]"
            ),
        ),
        "commit an expired lease after a takeover (the takeover does not fence the old token)",
    ),
    # -- one or more per guarantee ---------------------------------------------------------
    Mutant(
        "claim-overwrites-live-record",
        "G1",
        "effectfence/store/memory.py",
        "                if cur.token != observed_token or row not in _RECLAIMABLE:",
        "                if False:",
        _both("tests/test_chaos.py::test_interleaved_duplicate_claim_admits_exactly_one[{store}]"),
        "the claim step does not re-check the slot it observed",
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
        "evict-while-in-flight",
        "G5",
        "effectfence/store/memory.py",
        "            busy = self.in_flight(domain)\n            if busy:",
        "            busy = self.in_flight(domain)\n            if False:",
        _both("tests/test_stateful.py::test_evict_refused_while_in_flight[{store}]"),
        "evict_domain does not check for attempts in flight",
    ),
    Mutant(
        "expected-seq-ignored",
        "G6",
        "effectfence/store/memory.py",
        "            if strict is None:\n                seq = self._seqs.reserve(domain)",
        "            if True:\n                seq = self._seqs.reserve(domain)",
        _both(
            "tests/test_chaos.py::test_forced_domain_race_exactly_one_winner_every_trial[{store}]"
        ),
        "strict OCC: the compare-exchange becomes a plain reservation",
    ),
    Mutant(
        "own-seq-not-rechecked",
        "G6",
        "effectfence/fence.py",
        "        own_seq = ticket.seq if strict else None",
        "        own_seq = None",
        _both("tests/test_chaos.py::test_interleaved_expected_seq_moves_while_committing[{store}]"),
        "expected_seq is not re-validated at commit",
    ),
    Mutant(
        "read-set-unchecked-at-prepare",
        "G6",
        "effectfence/store/memory.py",
        "                stale = self._stale(others) if others else None\n",
        "                stale = None\n",
        _both("tests/test_stateful.py::test_read_set_checked_at_prepare_and_commit[{store}]"),
        "the read set is not checked at prepare",
    ),
    Mutant(
        "lost-race-creates-domain",
        "G7",
        "effectfence/store/memory.py",
        "                if self._seqs.find(domain) < 0:",
        "                if False:",
        _both("tests/test_stateful.py::test_refused_prepares_leave_no_trace[{store}]"),
        "a prepare refused domain_race leaves a new domain behind",
    ),
    Mutant(
        "sweep-reclaims-live",
        "G8",
        "effectfence/store/memory.py",
        "                    elif row is not Row.DONE_EXPIRED:",
        "                    elif False:",
        _both("tests/test_stateful.py::test_sweep_reclaims_exactly_the_expired[{store}]"),
        "sweep deletes whatever its wheel entry points at, live or not",
    ),
    Mutant(
        "no-auto-sweep",
        "G8",
        "effectfence/fence.py",
        "        if self._auto and now >= self._sweep_due[0]:",
        "        if False:",
        _both("tests/test_stateful.py::test_auto_sweep_bounds_memory[{store}]"),
        "expired records are only reclaimed when someone calls sweep()",
    ),
    Mutant(
        "sweep-reclaims-failed",
        "G9",
        "effectfence/store/memory.py",
        "                    elif row is not Row.DONE_EXPIRED:",
        "                    elif row not in (Row.DONE_EXPIRED, Row.FAILED):",
        _both("tests/test_stateful.py::test_sweep_reclaims_exactly_the_expired[{store}]"),
        "an aborted (unknown) intent is freed by the sweeper",
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
        "verify-trusts-hash",
        "G10",
        "effectfence/cert.py",
        "            return self.compute_hash() == self.hash",
        "            return len(self.hash) == 64",
        _both("tests/test_stateful.py::test_replayed_cert_is_tamper_evident[{store}]"),
        "verify() does not recompute the hash",
    ),
    # -- guards added after the review (tests/test_regressions.py) ---------------------------
    Mutant(
        "own-read-set-entry-not-atomic",
        "G6",
        "effectfence/store/memory.py",
        "            strict = expected_seq if expected_seq is not None else own\n",
        "            strict = expected_seq\n",
        tuple(
            "tests/test_regressions.py::"
            f"test_own_domain_read_set_is_checked_atomically_with_the_reservation[{k}]"
            for k in ("atomic", "pure")
        ),
        "a read-set entry on the claim's own domain is checked apart from the reservation",
    ),
    Mutant(
        "sweep-reclaims-lapsed-at-once",
        "G2",
        "effectfence/store/memory.py",
        "                        if now < reclaim_at:\n",
        "                        if False:\n",
        _both(
            "tests/test_regressions.py::"
            "test_lapsed_holder_not_taken_over_can_commit_despite_auto_sweep[{store}]"
        ),
        "sweep deletes a lapsed lease its holder could still commit",
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
    # -- the C accelerator's guards (the tree's extension is rebuilt from the mutated C) ---------
    Mutant(
        "c-commit-without-token-check",
        "G2",
        "csrc/effectfence_speedups.c",
        "    return PyObject_RichCompareBool(current, token, Py_EQ);\n",
        "    return 1;\n",
        ("tests/test_fence.py::test_g2_takeover_makes_old_ticket_powerless[memory-atomic]",),
        "the C commit takes any in-flight record as its own, whatever the token",
    ),
    Mutant(
        "c-replay-without-payload-check",
        "G4",
        "csrc/effectfence_speedups.c",
        "    if (bytes_equal(fp, payload) != 1) {\n",
        "    if (0) {\n",
        ("tests/test_fence.py::test_g4_changed_payload_conflicts_done[memory-atomic-changed0]",),
        "the C prepare replays a certificate to a request with another payload",
    ),
    Mutant(
        "c-replay-after-expiry",
        "G8",
        "csrc/effectfence_speedups.c",
        "    if (!(now < PyFloat_AS_DOUBLE(until))) {\n",
        "    if (0) {\n",
        ("tests/test_fence.py::test_g1_record_retained_until_result_ttl[memory-atomic]",),
        "the C prepare replays a result past its result_ttl",
    ),
    Mutant(
        "c-claim-without-recheck",
        "G1",
        "csrc/effectfence_speedups.c",
        "    PyObject *rec = PyDict_GetItemWithError(self->records, intent);\n"
        "    if (rec != NULL || PyErr_Occurred()) {\n",
        "    PyObject *rec = NULL;\n    if (PyErr_Occurred()) {\n",
        (
            "tests/test_speedups.py::"
            "test_claim_rechecks_under_the_lock_when_another_claim_gets_in_first",
        ),
        "the C claim trusts its unlocked read: a claim that got in first is overwritten",
    ),
    Mutant(
        "c-commit-without-recheck",
        "G2",
        "csrc/effectfence_speedups.c",
        "    int ok = cur != NULL && holds_lease(self, cur, token) == 1 &&\n",
        "    int ok = cur != NULL &&\n",
        ("tests/test_speedups.py::test_commit_rechecks_under_the_lock_when_the_lease_moves_first",),
        "the C commit trusts its unlocked check: an abort that got in first is overwritten",
    ),
    Mutant(
        "c-commit-ignores-read-set",
        "G6",
        "csrc/effectfence_speedups.c",
        "        !PyTuple_CheckExact(tk[TK_READ_SET]) || PyTuple_GET_SIZE(tk[TK_READ_SET]) ||\n",
        "        !PyTuple_CheckExact(tk[TK_READ_SET]) ||\n",
        ("tests/test_fence.py::test_g6_read_set_moving_during_effect_fails_commit[memory-atomic]",),
        "the C commit takes tickets with a read set and never re-validates it",
    ),
    Mutant(
        "admit-clock-at-edge",
        "G1",
        "effectfence/fence.py",
        "        if seq > MAX_SAFE_INTEGER or tick > MAX_SAFE_INTEGER:\n",
        "        if seq > MAX_SAFE_INTEGER:\n",
        _both(
            "tests/test_regressions.py::"
            "test_clock_at_the_edge_is_refused_at_prepare_not_after_the_effect_ran[{store}]"
        ),
        "a ticket whose clock a certificate cannot encode is admitted: it runs, never commits",
    ),
    Mutant(
        "c-admit-clock-at-edge",
        "G1",
        "csrc/effectfence_speedups.c",
        "    *at_edge = overflow || tick > MAX_SAFE_INTEGER;\n",
        "    *at_edge = 0;\n",
        (
            "tests/test_regressions.py::"
            "test_clock_at_the_edge_is_refused_at_prepare_not_after_the_effect_ran[memory-atomic]",
        ),
        "the C prepare admits a ticket whose clock a certificate cannot encode",
    ),
    Mutant(
        "c-no-auto-sweep",
        "G8",
        "csrc/effectfence_speedups.c",
        "        if (now >= next) {\n",
        "        if (0) {\n",
        ("tests/test_stateful.py::test_auto_sweep_bounds_memory[memory-atomic]",),
        "the C prepare never hands a due auto-sweep to the Python path: memory grows",
    ),
    Mutant(
        "c-expected-seq-ignored",
        "G6",
        "csrc/effectfence_speedups.c",
        "        int64_t got = self->advance_if(s, strict);\n",
        "        int64_t got = self->reserve(s);\n",
        (
            "tests/test_speedups.py::"
            "test_expected_seq_on_a_counted_domain_admits_one_view_and_refuses_the_rest",
        ),
        "the C claim reserves the next seq whatever expected_seq says",
    ),
    Mutant(
        "c-commit-skips-own-seq-check",
        "G6",
        "csrc/effectfence_speedups.c",
        "             (tk[TK_EXPECTED] == Py_None || "
        "own_seq_holds(self, cur_domain, tk[TK_SEQ]) == 1);\n",
        "             1;\n",
        (
            "tests/test_fence.py::test_g6_expected_seq_judged_against_own_reservation[memory-atomic]",
        ),
        "the C commit of a strict ticket ignores that its domain moved while the effect ran",
    ),
    Mutant(
        "c-request-skips-name-checks",
        "G7",
        "csrc/effectfence_speedups.c",
        "    return PyUnicode_CheckExact(o) && PyUnicode_IS_ASCII(o) && "
        "PyUnicode_GET_LENGTH(o) > 0 &&\n",
        "    return PyUnicode_CheckExact(o) && PyUnicode_IS_ASCII(o) &&\n",
        ("tests/test_speedups.py::test_request_init_in_c_refuses_what_python_refuses[call0]",),
        "the C request constructor accepts an empty name the Python one refuses",
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


_BUILD_SPEEDUPS = (
    "from setuptools import Extension, setup\n"
    "setup(name='mutant', script_args=['-q', 'build_ext', '--inplace'], ext_modules=[Extension("
    "'effectfence._speedups', ['csrc/effectfence_speedups.c'], "
    "extra_compile_args=['-std=c11', '-O2'])])\n"
)


def rebuild_speedups(tree: Path) -> None:
    """Compile the tree's (mutated) accelerator over the copied one, as setup.py would."""
    subprocess.run(
        [sys.executable, "-c", _BUILD_SPEEDUPS],
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


def _env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["EFFECTFENCE_DERANDOMIZE"] = "1"
    env.pop("EFFECTFENCE_COUNTERS", None)
    return env


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


def run_tests(tree: Path, nodeids: tuple[str, ...], timeout: float = 240.0) -> Outcome:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-rf"]
    proc = subprocess.run(
        [*cmd, *nodeids],
        cwd=tree,
        env=_env(tree),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    out = proc.stdout + proc.stderr
    failed = tuple(re.findall(r"^FAILED (\S+)", out, flags=re.M))
    return Outcome(proc.returncode, failed, out)


def killed(mutant: Mutant, outcome: Outcome) -> bool:
    return outcome.rc == 1 and any(f in mutant.killers for f in outcome.failed)


def run_mutant(mutant: Mutant) -> tuple[Mutant, Outcome]:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        tree = copy_tree(Path(tmp))
        try:
            apply(mutant, tree)
            if mutant.file.endswith(".c"):
                rebuild_speedups(tree)
        except AssertionError as exc:  # reported as a survivor, with the reason
            return mutant, Outcome(-1, (), str(exc))
        except subprocess.CalledProcessError as exc:  # a mutant that does not compile
            return mutant, Outcome(-1, (), f"rebuild failed:\n{exc.stdout}\n{exc.stderr}")
        return mutant, run_tests(tree, mutant.killers)


def all_killers() -> tuple[str, ...]:
    seen: dict[str, None] = {}
    for m in MUTANTS:
        for k in m.killers:
            seen[k] = None
    return tuple(seen)


def main(argv: list[str] | None = None) -> int:
    names = list(sys.argv[1:] if argv is None else argv)
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
        first = next((f for f in out.failed if f in m.killers), "-")
        print(f"{'KILLED ' if ok else 'SURVIVED'} {m.guarantee:4} {m.name:40} {first}")
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
