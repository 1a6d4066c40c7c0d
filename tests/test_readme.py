"""The README's Python examples run as written (against a fake bank that counts charges)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

README = (Path(__file__).parent.parent / "README.md").read_text()


class FakeBank:
    def __init__(self) -> None:
        self.charges: list[tuple[Any, ...]] = []

    def charge(self, *args: Any) -> Any:
        self.charges.append(args)
        return SimpleNamespace(id=f"ch_{len(self.charges)}")


def test_python_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the stores example opens ./fence.db
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) >= 2
    bank = FakeBank()
    namespace: dict[str, Any] = {"bank": bank}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
    assert namespace["cert"].verify()
    charge = namespace["charge"]
    first = charge(123, 500)
    assert charge(123, 500) == first  # the duplicate is served the recorded result
    assert len(bank.charges) == 2  # one from the prepare/commit example, one from charge()


ROOT = Path(__file__).parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_somewhere(doc: Path) -> None:
    """Every page the docs link to exists."""
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text())
    local = [t for t in targets if "://" not in t and not t.startswith("mailto:")]
    missing = [t for t in local if not (doc.parent / t).exists()]
    assert not missing, f"{doc.name} links to missing files: {missing}"


def test_figures_the_docs_quote_are_the_codes() -> None:
    """Numbers the docs state that are constants, not measurements: read from the code, so
    a change to one fails here until the docs say it too (found by review: the PostgreSQL
    page showed schema version 6 at 8, wrap's page a depth of 512 at 256)."""
    from effectfence.cert import MAX_PAYLOAD_DEPTH
    from effectfence.store.postgres import SCHEMA_VERSION

    pg = (ROOT / "docs" / "stores-postgres.md").read_text()
    assert re.findall(r"store_schema_version\s+(\d+)", pg) == [str(SCHEMA_VERSION)]
    wrap = (ROOT / "docs" / "wrap.md").read_text()
    assert f"nested up to {MAX_PAYLOAD_DEPTH} deep" in wrap
