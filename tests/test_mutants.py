"""Mutation proof: every named mutant of the core is killed by the tests named for it.

See ``tests/mutants/harness.py`` for how a mutant is applied (to a copy, never in place) and
``tests/mutants/MUTANTS.md`` for the table. A mutant that survives is a missing test.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.mutants.harness import (
    BUILDS,
    MUTANTS,
    ROOT,
    Mutant,
    Outcome,
    all_killers,
    check_snippets,
    compiled_available,
    copy_tree,
    killed,
    killers_in,
    run_mutant,
    run_tests,
    table_rows,
    which_package,
)

GUARANTEES = {f"G{i}" for i in range(1, 11)}


def test_every_snippet_exists_exactly_once() -> None:
    """The harness cannot rot silently: a changed core fails here, not as a fake kill."""
    assert check_snippets() == []


def test_every_guarantee_has_a_mutant() -> None:
    assert {m.guarantee for m in MUTANTS} == GUARANTEES
    assert len(MUTANTS) >= 16


def test_table_is_documented() -> None:
    doc = (Path(__file__).parent / "mutants" / "MUTANTS.md").read_text()
    assert doc.endswith(table_rows()), "run: python -m tests.mutants.harness --doc"
    for m in MUTANTS:
        assert f"`{m.name}`" in doc, m.name
        assert m.killers[0] in doc, m.killers[0]
    # the counts the prose gives (the README's drifted from 41 to "38", found by review)
    in_c = sum(m.name.startswith("c-") for m in MUTANTS)
    assert f"the {in_c} mutants of\nC code" in doc
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert f"{len(MUTANTS)} named\n  mutants" in readme


@pytest.fixture(scope="module")
def pristine() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as tmp:
        yield copy_tree(Path(tmp))


def test_copy_imports_the_copied_package(pristine: Path) -> None:
    here = which_package(pristine)
    assert Path(here).resolve().is_relative_to(pristine.resolve()), here
    assert not Path(here).resolve().is_relative_to((ROOT / "effectfence").resolve())
    assert list((pristine / "effectfence").glob("_effectfence_atomic*.so")) or not list(
        (ROOT / "effectfence").glob("_effectfence_atomic*.so")
    )


@pytest.mark.parametrize("build", BUILDS)
def test_killers_pass_without_mutants(pristine: Path, build: str) -> None:
    """Otherwise a "kill" would prove nothing."""
    if build == "atomic" and not compiled_available():
        pytest.skip("no compiled core in this checkout")
    out = run_tests(pristine, killers_in(build, all_killers()), build=build)
    assert out.rc == 0, out.output[-3000:]


@pytest.fixture(scope="module")
def outcomes() -> dict[str, Outcome]:
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return {m.name: out for m, out in pool.map(run_mutant, MUTANTS)}


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_is_killed(mutant: Mutant, outcomes: dict[str, Outcome]) -> None:
    out = outcomes[mutant.name]
    assert killed(mutant, out), (
        f"{mutant.name} ({mutant.guarantee}: {mutant.what}) SURVIVED "
        f"rc={out.rc}, failed={out.failed}\n{out.output[-3000:]}"
    )
