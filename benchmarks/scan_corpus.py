"""Measure ``effectfence scan`` on published MCP servers nobody here wrote.

The corpus (``benchmarks/scan_corpus.toml``) pins each server by registry, version and
sha256, and labels every tool ``effect`` or ``read`` (``idempotent`` where a duplicate is
harmless by construction) with the line that justifies it.  This script downloads the
artifacts into a cache with the registries' own clients (``pip download --no-deps``,
``npm pack``), refuses any whose sha256 differs, unpacks them, scans each one as a user
would (the unpacked wheel or npm tarball, nothing else) and reports per server and
overall:

- recall: effect tools (not idempotent) scoring at or above the could-fire-twice line;
- read tools flagged: read tools at or above that line (false positives);
- wrong names: tools the scan reports that no client can call (not in the labels), and
  labelled tools it did not find.

Idempotent effect tools count in neither rate; how many of them are flagged is shown.

    python benchmarks/scan_corpus.py [--cache DIR] [--json] [--show-lines] [--offline]

The cache defaults to ``$EFFECTFENCE_SCAN_CORPUS`` or ``~/.cache/effectfence/scan-corpus``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from effectfence.scan import COULD_FIRE_TWICE, scan_path  # noqa: E402

CORPUS = Path(__file__).with_name("scan_corpus.toml")
LABELS = ("effect", "read")


class CorpusError(Exception):
    """A download failed, or an artifact is not the one the corpus pins."""


def default_cache() -> Path:
    env = os.environ.get("EFFECTFENCE_SCAN_CORPUS")
    return Path(env) if env else Path.home() / ".cache" / "effectfence" / "scan-corpus"


def load_corpus(path: Path = CORPUS) -> list[dict[str, Any]]:
    """The servers of the label file, checked for shape (also run by the test suite)."""
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    servers = data.get("server")
    if not isinstance(servers, list) or not servers:
        raise CorpusError(f"{path}: no [[server]] entries")
    for s in servers:
        where = f"{path}: server {s.get('name')!r}"
        for key in ("name", "registry", "version", "file", "sha256", "style", "tools"):
            if key not in s:
                raise CorpusError(f"{where}: missing {key}")
        if s["registry"] not in ("pypi", "npm"):
            raise CorpusError(f"{where}: registry must be pypi or npm")
        if len(s["sha256"]) != 64 or any(c not in "0123456789abcdef" for c in s["sha256"]):
            raise CorpusError(f"{where}: sha256 must be 64 lowercase hex digits")
        if not s["tools"]:
            raise CorpusError(f"{where}: no tools")
        for tool, label in s["tools"].items():
            if label.get("label") not in LABELS:
                raise CorpusError(f"{where}: tool {tool!r}: label must be one of {LABELS}")
            if label.get("idempotent") and label["label"] != "effect":
                raise CorpusError(f"{where}: tool {tool!r}: only an effect can be idempotent")
            file, _, line = str(label.get("line", "")).rpartition(":")
            if not file or not line.isdigit():
                raise CorpusError(f"{where}: tool {tool!r}: line must be path:number")
            if not str(label.get("why", "")).strip():
                raise CorpusError(f"{where}: tool {tool!r}: say why")
    return servers


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(server: dict[str, Any], cache: Path, *, offline: bool = False) -> Path:
    """The verified artifact in the cache, downloaded first if it is not there."""
    artifact = cache / "artifacts" / server["file"]
    if not artifact.exists():
        if offline:
            raise CorpusError(f"{server['name']}: {artifact} is not cached (--offline)")
        artifact.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=artifact.parent) as tmp:
            if server["registry"] == "pypi":
                cmd = [
                    sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--ignore-requires-python", "-q", "-d", tmp,
                    f"{server['name']}=={server['version']}",
                ]  # fmt: skip
            else:
                cmd = ["npm", "pack", "--silent", "--pack-destination", tmp,
                       f"{server['name']}@{server['version']}"]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            got = Path(tmp) / server["file"]
            if proc.returncode != 0 or not got.exists():
                raise CorpusError(
                    f"{server['name']} {server['version']}: download failed "
                    f"({' '.join(cmd)}): {proc.stderr.strip()[-500:] or 'no ' + server['file']}"
                )
            got.replace(artifact)
    digest = _sha256(artifact)
    if digest != server["sha256"]:
        raise CorpusError(
            f"{server['name']} {server['version']}: sha256 mismatch for {artifact}: "
            f"expected {server['sha256']}, got {digest}. The registry served different "
            "bytes than the corpus pins; delete the file to download again, and do not "
            "update the pin without re-reading the labels."
        )
    return artifact


def unpack(artifact: Path, cache: Path) -> Path:
    """Unpack once into ``cache/unpacked/<artifact>``; the folder a user would scan."""
    dest = cache / "unpacked" / artifact.name
    done = dest / ".unpacked"
    if done.exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    if artifact.suffix == ".whl":
        with zipfile.ZipFile(artifact) as zf:
            for member in zf.namelist():
                target = (dest / member).resolve()
                if not target.is_relative_to(dest.resolve()):
                    raise CorpusError(f"{artifact}: unsafe member {member}")
            zf.extractall(dest)
    else:
        with tarfile.open(artifact) as tf:
            tf.extractall(dest, filter="data")
    done.write_text("")
    return dest


@dataclass
class ServerScore:
    name: str
    version: str
    effects: int = 0
    effects_flagged: int = 0
    reads: int = 0
    reads_flagged: int = 0
    idempotent: int = 0
    idempotent_flagged: int = 0
    wrong_names: list[str] = field(default_factory=list)
    not_found: list[str] = field(default_factory=list)
    missed: list[str] = field(default_factory=list)
    read_flagged: list[str] = field(default_factory=list)

    @property
    def recall(self) -> float | None:
        return self.effects_flagged / self.effects if self.effects else None

    @property
    def read_fp(self) -> float | None:
        return self.reads_flagged / self.reads if self.reads else None


def score_server(server: dict[str, Any], folder: Path) -> ServerScore:
    report = scan_path(folder, min_score=0)
    scores: dict[str, int] = {}
    for f in report.findings:
        scores[f.tool] = max(scores.get(f.tool, 0), f.score)
    out = ServerScore(server["name"], server["version"])
    labels: dict[str, dict[str, Any]] = server["tools"]
    out.wrong_names = sorted(set(scores) - set(labels))
    for tool, label in labels.items():
        flagged = scores.get(tool, 0) >= COULD_FIRE_TWICE
        if tool not in scores:
            out.not_found.append(tool)
        if label["label"] == "read":
            out.reads += 1
            out.reads_flagged += flagged
            if flagged:
                out.read_flagged.append(tool)
        elif label.get("idempotent"):
            out.idempotent += 1
            out.idempotent_flagged += flagged
        else:
            out.effects += 1
            out.effects_flagged += flagged
            if not flagged:
                out.missed.append(tool)
    return out


def _rate(a: int, b: int) -> str:
    return f"{a / b:.2f} ({a}/{b})" if b else "-"


def render(scores: list[ServerScore]) -> str:
    rows = [("server", "recall", "read flagged", "idempotent flagged", "wrong names")]
    for s in scores:
        rows.append(
            (
                f"{s.name}@{s.version}",
                _rate(s.effects_flagged, s.effects),
                _rate(s.reads_flagged, s.reads),
                f"{s.idempotent_flagged}/{s.idempotent}",
                str(len(s.wrong_names) + len(s.not_found)),
            )
        )
    tot = ServerScore("overall", "")
    for s in scores:
        for f in ("effects", "effects_flagged", "reads", "reads_flagged", "idempotent",
                  "idempotent_flagged"):  # fmt: skip
            setattr(tot, f, getattr(tot, f) + getattr(s, f))
        tot.wrong_names += s.wrong_names
        tot.not_found += s.not_found
    rows.append(
        (
            f"overall ({len(scores)} servers)",
            _rate(tot.effects_flagged, tot.effects),
            _rate(tot.reads_flagged, tot.reads),
            f"{tot.idempotent_flagged}/{tot.idempotent}",
            str(len(tot.wrong_names) + len(tot.not_found)),
        )
    )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(-1, lines[1])
    notes = []
    for s in scores:
        for what, items in (
            ("missed effect", s.missed),
            ("read flagged", s.read_flagged),
            ("wrong name", s.wrong_names),
            ("not found", s.not_found),
        ):
            if items:
                notes.append(f"  {s.name}: {what}: {', '.join(items)}")
    head = f"effectfence scan on the corpus; flagged = score >= {COULD_FIRE_TWICE}\n"
    return head + "\n".join(lines) + ("\n" + "\n".join(notes) if notes else "") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=default_cache(), help="download cache")
    parser.add_argument("--json", action="store_true", help="print per-server results as JSON")
    parser.add_argument("--offline", action="store_true", help="use the cache only")
    parser.add_argument(
        "--show-lines", action="store_true", help="print each label's justifying line"
    )
    args = parser.parse_args(argv)
    try:
        servers = load_corpus()
        scores = []
        for server in servers:
            folder = unpack(fetch(server, args.cache, offline=args.offline), args.cache)
            if args.show_lines:
                for tool, label in server["tools"].items():
                    file, _, num = label["line"].rpartition(":")
                    text = (folder / file).read_text(encoding="utf-8").splitlines()[int(num) - 1]
                    print(f"{server['name']} {tool} [{label['label']}] {label['line']}: "
                          f"{text.strip()}")  # fmt: skip
            scores.append(score_server(server, folder))
    except CorpusError as exc:
        print(f"scan_corpus: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([{**s.__dict__, "recall": s.recall, "read_fp": s.read_fp}
                          for s in scores], indent=2))  # fmt: skip
    elif not args.show_lines:
        sys.stdout.write(render(scores))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
