"""Committed intents across a crash and restart of the store's *server*.

The shared servers on 127.0.0.1 belong to the whole suite (and to the machine), so these
tests start private ones: a Redis on a free port, and a PostgreSQL cluster made with initdb.
Each server is killed the way a crash kills it (SIGKILL; ``pg_ctl -m immediate``), started
again on the same files, and a new store (a new process's view) asks for the same intent.

What they prove, per the settings the docs call safe or not (docs/stores-redis.md,
docs/stores-postgres.md): PostgreSQL keeps every acknowledged step (``synchronous_commit``
on); Redis keeps them with ``appendonly yes`` + ``appendfsync always``, and without an
append-only file forgets them, so the same intent is fresh again: a second execution. The
store's own durability report says which it is, before anything is lost.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import REQUIRE_SERVICES

from effectfence import EffectFence, EffectRequest, FenceConfig

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


def _need_binary(path: str | None, what: str) -> str:
    if path and os.path.exists(path):
        return path
    msg = f"{what} is not installed here"
    if REQUIRE_SERVICES:
        pytest.fail(msg + "; EFFECTFENCE_REQUIRE_SERVICES=1 makes this a failure", pytrace=False)
    pytest.skip(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _until(cond: Callable[[], Any], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if cond():
                return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _req(agent: str) -> EffectRequest:
    return EffectRequest("restart:1", "order:9", "charge", {"cents": 500}, agent)


def _commit_once(fence: EffectFence) -> str:
    adm = fence.prepare(_req("first"))
    assert adm.fresh
    return fence.commit(adm.ticket, {"charged": 500}).hash


# -- Redis --------------------------------------------------------------------------------


class _Redis:
    def __init__(self, workdir: Path, persistence: list[str]) -> None:
        self.binary = _need_binary(shutil.which("redis-server"), "redis-server")
        self.port = _free_port()
        self.args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(workdir),
            "--save",
            "",
            *persistence,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)
        _until(client.ping, f"redis-server on port {self.port}")
        client.close()

    def crash(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.crash()


@pytest.mark.parametrize(
    "persistence, kept",
    [
        (["--appendonly", "yes", "--appendfsync", "always"], True),
        (["--appendonly", "no"], False),
    ],
    ids=["aof-always", "no-aof"],
)
def test_redis_server_crash_keeps_commits_only_with_an_fsynced_aof(
    tmp_path: Path, persistence: list[str], kept: bool
) -> None:
    from effectfence.store.redis import RedisStore

    server = _Redis(tmp_path, persistence)
    server.start()
    try:
        store = RedisStore(server.url)
        # the store says, before anything is lost, whether a crash can lose a step
        assert store.durability()["acknowledged_writes_survive_a_crash"] is kept
        first = _commit_once(EffectFence(store=store))
        store.close()
        server.crash()
        server.start()
        again = EffectFence(store=RedisStore(server.url)).prepare(_req("second"))
        if kept:
            assert not again.fresh and again.cert.hash == first  # replayed: ran once
        else:
            # forgotten: the same intent would run a second time. This is why the docs
            # and the durability verdict say these settings are not for money.
            assert again.fresh
    finally:
        server.stop()


# -- PostgreSQL ---------------------------------------------------------------------------


def _pg_bin() -> Path | None:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return found[-1].parent if found else None


class _Postgres:
    """A private cluster: initdb (as the ``postgres`` user when run as root, which initdb
    refuses to be), one server on a free loopback port, crashed with ``-m immediate``."""

    def __init__(self, workdir: Path) -> None:
        bindir = _pg_bin()
        self.bin = Path(_need_binary(str(bindir / "pg_ctl") if bindir else None, "PostgreSQL"))
        self.bin = self.bin.parent  # initdb, pg_ctl
        self.data = workdir / "data"
        self.port = _free_port()
        self.user: list[str] = []
        if os.geteuid() == 0:
            runuser = shutil.which("runuser")
            if runuser is None:
                pytest.skip("running as root without runuser: initdb cannot run")
            self.user = [runuser, "-u", "postgres", "--"]
            os.chown(workdir, _uid("postgres"), -1)
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        # the server fsyncs as production does; only initdb's own files skip it

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self.user, str(self.bin / tool), *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd="/",
        )

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        # A careless default, as a shared server may have: commits acknowledged before
        # their WAL is flushed, flushed every 10 s. The store must switch its sessions to
        # synchronous_commit=on, or the crash below loses what it acknowledged.
        opts = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.data} -c fsync=on "
            "-c synchronous_commit=off -c wal_writer_delay=10s"
        )
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-w", "-t", "60", "start")

    def crash(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self.crash()


def _uid(name: str) -> int:
    import pwd

    return pwd.getpwnam(name).pw_uid


@pytest.fixture
def private_pg() -> Iterator[_Postgres]:
    # not under tmp_path: pytest's base directory is private to root, and the server runs
    # as the postgres user
    workdir = Path(tempfile.mkdtemp(prefix="effectfence-pg-"))
    try:
        server = _Postgres(workdir)
        server.start()
        try:
            yield server
        finally:
            server.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_postgres_server_crash_keeps_every_acknowledged_commit(private_pg: _Postgres) -> None:
    from effectfence.store.postgres import PostgresStore

    store = PostgresStore(private_pg.dsn, pool_max=2)
    described = store.describe()
    assert described["synchronous_commit"] == "on"
    assert any("synchronous_commit was off" in note for note in described["notes"])
    fence = EffectFence(store=store)
    first = _commit_once(fence)
    held = fence.prepare(EffectRequest("restart:2", "order:9", "charge", {}, "first")).ticket
    store.close()
    private_pg.crash()  # no checkpoint, no clean shutdown: recovery replays the WAL
    private_pg.start()
    store = PostgresStore(private_pg.dsn, pool_max=2)
    try:
        again = EffectFence(store=store)
        replay = again.prepare(_req("second"))
        assert not replay.fresh and replay.cert.hash == first
        # the claim survived too: the holder's lease still fences the intent
        record = store.get("restart:2")
        assert record is not None and record.token == held.token
    finally:
        store.close()


def test_postgres_a_commit_on_the_callers_pool_survives_a_crash_after_the_app_set_async(
    private_pg: _Postgres,
) -> None:
    """The application's pool, its sessions starting with synchronous_commit on. The store
    checked each connection the first time it borrowed it; the application then turned
    synchronous_commit off on that session for its own bulk writes, as it may, and the
    store's next steps on it were acknowledged before their WAL was flushed: a crash lost
    the committed intent, and the duplicate after the restart was fresh, a second execution
    (G1; found by review). Each borrow now sets it on."""
    import psycopg_pool

    from effectfence.store.postgres import PostgresStore

    dsn = private_pg.dsn + "?options=-c%20synchronous_commit%3Don"
    pool = psycopg_pool.ConnectionPool(dsn, min_size=1, max_size=1, open=False)
    pool.open(wait=True)
    store = PostgresStore(pool=pool, schema="callers_pool")
    fence = EffectFence(FenceConfig(lease_ttl=1.0), store=store)
    fence.current("warm")  # the store has borrowed (and checked) the pool's one connection
    with pool.connection() as c:  # the application's own work on its pool
        c.execute("SET synchronous_commit = off")
    first = _commit_once(fence)
    store.close()
    pool.close()
    private_pg.crash()
    private_pg.start()
    # judged 2 s on: past the first attempt's lease, had its commit been lost
    store = PostgresStore(private_pg.dsn, schema="callers_pool", pool_max=2,
                          clock=lambda: time.time() + 2)  # fmt: skip
    try:
        again = EffectFence(store=store).prepare(_req("second"))
        assert not again.fresh and again.cert.hash == first, again
    finally:
        store.close()
