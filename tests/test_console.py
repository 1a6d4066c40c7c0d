"""The console page: its gates over HTTP, and the whole operator's round in a real browser,
on ``effectfence console`` and on ``effectfence serve --http --console`` (the console mounted
on the MCP server, charting its fence_stats counters while real MCP clients use it).

The browser is Debian's headless Chromium driven by Selenium. Missing, it is installed
(``apt-get install chromium chromium-driver``, as root) once per session; if it still
cannot run, the browser test skips, or with EFFECTFENCE_REQUIRE_SERVICES=1 (CI) fails.
The screenshot lands in tests/artifacts/ (gitignored) and its path is printed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp_support import http_server as spawn_http_server
from mcp_support import http_session
from support import sqlite_path

from effectfence import EffectFence, EffectRequest, FenceConfig
from effectfence.operator.console import (
    CSRF_HEADER,
    Console,
    ConsoleServer,
    allowed_names,
    check_bind,
    serve,
)

SECRET = "4111-1111-1111-1111"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
REQUIRE = os.environ.get("EFFECTFENCE_REQUIRE_SERVICES") == "1"
TOKEN = "s3cret-token-for-the-console-0123"


def req(n: int) -> EffectRequest:
    return EffectRequest(f"charge:{n}", "order:1", "charge", {"card": SECRET}, "agent-a")


@pytest.fixture
def fence() -> Iterator[EffectFence]:
    f = EffectFence.from_url(f"sqlite:///{sqlite_path().lstrip('/')}", FenceConfig())
    yield f
    f.close()


@pytest.fixture
def console(fence: EffectFence) -> Iterator[ConsoleServer]:
    server = serve(fence, stats_fence=fence, who="tester")
    server.start(every=0.2)
    yield server
    server.stop()


def call(
    url: str, *, data: Any = None, headers: dict[str, str] | None = None, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    body = (
        None if data is None else (data if isinstance(data, bytes) else json.dumps(data).encode())
    )
    request = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    opener = urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(request, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kw: Any) -> None:
        return None


# -- the gates, over HTTP --------------------------------------------------------------------------


def test_non_loopback_bind_needs_tokens() -> None:
    with pytest.raises(ValueError, match="--tokens"):
        check_bind("0.0.0.0", None)
    check_bind("127.0.0.1", None)
    check_bind("::1", None)
    check_bind("0.0.0.0", object())


def test_clear_needs_the_pages_csrf_token_and_origin(
    fence: EffectFence, console: ConsoleServer
) -> None:
    fence.abort(fence.prepare(req(1)).ticket, "bank timeout")  # type: ignore[union-attr]
    clear = {"intent": "charge:1", "reason": "refunded"}
    status, _, _ = call(console.url + "/api/clear", data=clear, method="POST")
    assert status == 403
    csrf = console.console._open_csrf
    hdr = {CSRF_HEADER: csrf, "Origin": "http://evil.example"}
    status, _, _ = call(console.url + "/api/clear", data=clear, headers=hdr, method="POST")
    assert status == 403
    assert fence.intent_status("charge:1").state == "failed", "refused: nothing cleared"
    # the page carries the token; a request from it passes
    status, _, page = call(console.url + "/intent?id=charge%3A1")
    assert status == 200 and csrf.encode() in page and SECRET.encode() not in page
    hdr = {CSRF_HEADER: csrf, "Origin": console.url}
    status, _, body = call(console.url + "/api/clear", data=clear, headers=hdr, method="POST")
    out = json.loads(body)
    assert status == 200 and out["cleared"] and out["audit"]["who"] == "tester (console)"
    status, _, body = call(console.url + "/api/clear", data=clear, headers=hdr, method="POST")
    assert status == 404  # nothing left to clear


def test_live_lease_refused_over_http_unless_forced(
    fence: EffectFence, console: ConsoleServer
) -> None:
    fence.prepare(req(1))
    hdr = {CSRF_HEADER: console.console._open_csrf}
    body = {"intent": "charge:1", "reason": "stuck?"}
    status, _, out = call(console.url + "/api/clear", data=body, headers=hdr, method="POST")
    assert status == 409 and json.loads(out)["code"] == "intent_in_flight"
    status, _, out = call(
        console.url + "/api/clear", data={**body, "force": True}, headers=hdr, method="POST"
    )
    assert status == 200 and json.loads(out)["audit"]["forced"] is True
    status, _, out = call(
        console.url + "/api/clear", data={"intent": "x", "reason": ""}, headers=hdr, method="POST"
    )
    assert status == 400


def test_unknown_host_is_refused(console: ConsoleServer) -> None:
    status, _, _ = call(console.url + "/", headers={"Host": "attacker.example:80"})
    assert status == 421


def test_answers_leave_without_waiting_for_an_ack(console: ConsoleServer) -> None:
    """Nagle off on every accepted connection (headers and body are two writes)."""
    import socket

    from effectfence.operator import console as module

    seen: list[int] = []

    class Probe(module._Handler):
        def setup(self) -> None:
            super().setup()
            seen.append(self.connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    console.RequestHandlerClass = Probe
    status, _, _ = call(console.url + "/healthz")
    assert status == 200 and seen and seen[0] != 0


@pytest.mark.parametrize(
    ("framing", "status"),
    [
        (b"Content-Length: -1\r\n", b" 400 "),
        (b"Content-Length: 1e3\r\n", b" 400 "),
        (b"Transfer-Encoding: chunked\r\n", b" 411 "),
        (b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", b" 411 "),
    ],
)
def test_a_body_the_console_cannot_bound_is_refused_before_it_is_read(
    fence: EffectFence, framing: bytes, status: bytes
) -> None:
    """Before any login: a negative length read until the client closed (past MAX_BODY,
    holding a thread for as long as the client liked), and a chunked body went unread and
    was parsed as the next request (found by review). Each is refused at once, and the
    connection closed, with the client still sending."""
    import socket

    from effectfence.mcp.http import Principals

    server = serve(fence, principals=Principals.parse(f"ops {TOKEN}"))
    server.start(every=5.0)
    try:
        host, port = server.server_address[:2]
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(
                b"POST /api/clear HTTP/1.1\r\nHost: 127.0.0.1\r\n" + framing + b"\r\n"
                + b"x" * 1024
            )  # fmt: skip
            answer = b""
            while chunk := sock.recv(65536):  # ends: the server closes the connection
                answer += chunk
        assert status in answer.split(b"\r\n", 1)[0], answer[:200]
    finally:
        server.stop()


def test_with_tokens_every_page_needs_them(fence: EffectFence) -> None:
    from effectfence.mcp.http import Principals

    server = serve(fence, principals=Principals.parse(f"ops {TOKEN}"))
    server.start(every=5.0)
    try:
        base = server.url
        assert call(base + "/healthz")[0] == 200
        assert call(base + "/api/intents")[0] == 401
        status, headers, _ = call(base + "/")
        assert status == 303 and headers["Location"] == "/login"
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert call(base + "/api/intents", headers=bearer)[0] == 200
        form = f"token={TOKEN}".encode()
        ctype = {"Content-Type": "application/x-www-form-urlencoded"}
        status, _, _ = call(
            base + "/login",
            data=form,
            method="POST",
            headers={**ctype, "Origin": "http://evil.example"},
        )
        assert status == 403
        status, _, _ = call(
            base + "/login", data=b"token=wrong-token-xxxxxxxxxx", method="POST", headers=ctype
        )
        assert status == 401
        status, headers, _ = call(base + "/login", data=form, method="POST", headers=ctype)
        cookie = headers["Set-Cookie"]
        assert status == 303 and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        # the login's pages live under a path of its own, and its cookie names that path
        # only: browsers send a host's cookies to every port on it, so a cookie for "/"
        # reached whatever else listened on the machine (found by review)
        home = headers["Location"]
        assert home.startswith("/s/") and home.endswith("/") and len(home) > 10
        assert f"Path={home};" in cookie + ";"
        session = {"Cookie": cookie.split(";")[0]}
        status, _, page = call(base + home, headers=session)
        assert status == 200 and b"signed in as ops" in page
        assert f'const BASE="{home[:-1]}"'.encode() in page  # its links stay on its path
        assert call(base + home + "api/intents", headers=session)[0] == 200
        # the cookie anywhere else opens nothing: the plain paths, another login's path
        status, headers, _ = call(base + "/", headers=session)
        assert status == 303 and headers["Location"] == "/login"
        assert call(base + "/api/intents", headers=session)[0] == 401
        other = call(base + "/login", data=form, method="POST", headers=ctype)[1]["Location"]
        assert other != home
        assert call(base + other + "api/intents", headers=session)[0] == 401
        assert call(base + home + "api/intents", headers=bearer)[0] == 401  # cookie paths only
        fence.abort(fence.prepare(req(1)).ticket, "x")  # type: ignore[union-attr]
        body = {"intent": "charge:1", "reason": "done by ops"}
        # a session (a browser) needs its CSRF token; a bearer client does not
        clear = base + home + "api/clear"
        assert call(clear, data=body, headers=session, method="POST")[0] == 403
        status, _, out = call(base + "/api/clear", data=body, headers=bearer, method="POST")
        assert status == 200 and json.loads(out)["audit"]["who"] == "ops (console)"
    finally:
        server.stop()


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="SIGHUP is POSIX's")
def test_the_console_command_reloads_its_tokens_on_sighup(tmp_path: Path) -> None:
    """The docs revoke a console token by rewriting the file and sending SIGHUP, as for
    serve --http; the console had no handler, so SIGHUP ended it (found by review)."""
    import json
    import sys

    tokens = tmp_path / "tokens"
    tokens.write_text(f"ops {TOKEN}\n")
    tokens.chmod(0o600)
    db = tmp_path / "f.db"
    EffectFence.from_url(f"sqlite:///{db}").close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "effectfence", "console", "--store", f"sqlite:///{db}",
         "--http", "127.0.0.1:0", "--tokens", str(tokens)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stderr is not None
        base = json.loads(proc.stderr.readline())["url"].rstrip("/")
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        assert call(base + "/api/intents", headers=bearer)[0] == 200
        tokens.write_text(f"bob {TOKEN}-new\n")  # ops's token revoked
        proc.send_signal(signal.SIGHUP)
        said = json.loads(proc.stderr.readline())
        assert said["event"] == "tokens_reloaded" and said["principals"] == 1, said
        assert proc.poll() is None, "SIGHUP ended the console"
        assert call(base + "/api/intents", headers=bearer)[0] == 401
        new = {"Authorization": f"Bearer {TOKEN}-new"}
        assert call(base + "/api/intents", headers=new)[0] == 200
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_console_login_ends_with_its_token_and_its_time(
    fence: EffectFence, tmp_path: Path
) -> None:
    """A browser's session is as good as the token it logged in with: revoked (SIGHUP
    reloads the file) or moved to another principal, the session ends at its next request;
    it ends after SESSION_TTL anyway; and logins kept are bounded, oldest dropped first."""
    from effectfence.mcp.http import Principals
    from effectfence.operator import console as console_module

    tokens = tmp_path / "tokens"
    other = "another-token-for-the-console-456"
    tokens.write_text(f"ops {TOKEN}\nbob {other}\n")
    tokens.chmod(0o600)
    principals = Principals.load(tokens)
    now = [1000.0]
    console = Console(fence, principals=principals, clock=lambda: now[0])
    host = {"Host": "127.0.0.1:1"}

    def login(token: str = TOKEN) -> dict[str, str]:
        status, _, _, headers = console.handle("POST", "/login", host, f"token={token}".encode())
        assert status == 303, status
        got = dict(headers)
        return {**host, "Cookie": got["Set-Cookie"].split(";")[0], "home": got["Location"]}

    def status(session: dict[str, str]) -> int:
        return console.handle("GET", session["home"] + "api/stats", session, b"")[0]

    session = login()
    assert status(session) == 200
    tokens.write_text(f"bob {other}\n")  # ops's token revoked
    assert principals.reload()["tokens"] == 1
    assert status(session) == 401, "a revoked token's session still works"
    tokens.write_text(f"ops {TOKEN}\nbob {other}\n")
    principals.reload()
    assert status(session) == 401  # ended, not suspended
    session = login()
    tokens.write_text(f"bob {TOKEN}\n")  # the same token, now naming another principal
    principals.reload()
    assert status(session) == 401
    tokens.write_text(f"ops {TOKEN}\n")
    principals.reload()
    session = login()
    now[0] += console_module.SESSION_TTL - 1
    assert status(session) == 200
    now[0] += 1
    assert status(session) == 401, "a login outlived SESSION_TTL"
    first = login()
    for _ in range(console_module.MAX_SESSIONS):
        last = login()
    assert (status(first), status(last)) == (401, 200)
    assert len(console._sessions) == console_module.MAX_SESSIONS


def test_an_intent_name_no_store_can_hold_is_a_400(fence: EffectFence) -> None:
    """/api/intent?id=a%00b read the store directly: a raw driver error on PostgreSQL."""
    console = Console(fence)
    host = {"Host": "127.0.0.1:1"}
    status, _, body, _ = console.handle("GET", "/api/intent?id=a%00b", host, b"")
    assert status == 400 and json.loads(body)["code"] == "invalid_request"
    assert console.handle("GET", "/intent?id=a%00b", host, b"")[0] == 400


@pytest.mark.parametrize(
    "name",
    [
        "x'.length,globalThis.RAN=1,'",  # ends a single-quoted literal
        'order "42"',
        "o'brien",
        "path\\to",
        "line\u2028sep</script><script>globalThis.RAN=1</script>",
    ],
)
def test_an_intent_name_is_data_in_the_page_never_script(fence: EffectFence, name: str) -> None:
    """The detail page put its data in JSON.parse('...'): a quote in an intent name (which
    agents choose) ended the literal and ran as script in the console's origin, so an
    agent could make the operator's browser force-clear a live lease (found by review);
    harmless names broke the page. The page's own script, run by node, reads the name
    back exactly and runs nothing else."""
    if shutil.which("node") is None:  # the Inspector's tests need it as well
        (pytest.fail if REQUIRE else pytest.skip)("node is not installed")
    fence.prepare(EffectRequest(name, "order:1", "charge", {}, "agent-a"))
    console = Console(fence, who="tester")
    status, _, page, _ = console.handle(
        "GET", f"/intent?id={urllib.parse.quote(name, safe='')}", {"Host": "127.0.0.1:1"}, b""
    )
    assert status == 200
    script = page.decode().rsplit("<script>", 1)[1].split("</script>")[0]
    harness = (
        "globalThis.document={getElementById(){return null}};"
        f"{script}\nprocess.stdout.write(JSON.stringify([D.intent, globalThis.RAN||0]));"
    )
    out = subprocess.run(["node", "-e", harness], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr[-500:]
    assert json.loads(out.stdout) == [name, 0]


def test_a_look_only_console_refuses_to_clear(fence: EffectFence) -> None:
    """``allow_clear=False`` (serve --console without --allow-clear): no form, no clear."""
    fence.abort(fence.prepare(req(1)).ticket, "x")  # type: ignore[union-attr]
    console = Console(fence, who="tester", allow_clear=False)
    hdr = {"Host": "127.0.0.1:1", CSRF_HEADER: console._open_csrf}
    status, _, page, _ = console.handle("GET", "/intent?id=charge%3A1", hdr, b"")
    assert status == 200 and b"id=clear-off" in page and b"id=clear-form" not in page
    body = json.dumps({"intent": "charge:1", "reason": "r", "force": True}).encode()
    status, _, out, _ = console.handle("POST", "/api/clear", hdr, body)
    assert status == 403 and json.loads(out)["error"] == "clear_disabled"
    assert fence.intent_status("charge:1").state == "failed" and fence.audit() == []


@pytest.mark.parametrize("body", [b"[" * 60_000, b'{"intent": ' + b"[" * 60_000, b"{"])
def test_a_malformed_clear_body_is_a_400_not_an_exception(fence: EffectFence, body: bytes) -> None:
    """Review 2, bug 3: a deeply nested body raised RecursionError out of the handler."""
    fence.abort(fence.prepare(req(1)).ticket, "x")  # type: ignore[union-attr]
    console = Console(fence, who="tester")
    hdr = {"Host": "127.0.0.1:1", CSRF_HEADER: console._open_csrf}
    status, _, out, _ = console.handle("POST", "/api/clear", hdr, body)
    assert status == 400 and json.loads(out)["code"] == "invalid_request"
    assert fence.intent_status("charge:1").state == "failed" and fence.audit() == []


def test_a_console_below_a_base_path_names_it_everywhere(fence: EffectFence) -> None:
    from effectfence.mcp.http import Principals

    fence.abort(fence.prepare(req(1)).ticket, "x")  # type: ignore[union-attr]
    console = Console(fence, principals=Principals.parse(f"ops {TOKEN}"), base="/console")
    host = {"Host": "127.0.0.1:1"}
    bearer = {**host, "Authorization": f"Bearer {TOKEN}"}
    for outside in ("/", "/api/stats", "/consoles", "/intent?id=charge%3A1"):
        assert console.handle("GET", outside, bearer, b"")[0] == 404, outside
    status, _, _, headers = console.handle("GET", "/console/", host, b"")
    assert status == 303 and dict(headers)["Location"] == "/console/login"
    status, _, page, _ = console.handle("GET", "/console/login", host, b"")
    assert b"action='/console/login'" in page
    form = f"token={TOKEN}".encode()
    status, _, _, headers = console.handle("POST", "/console/login", host, form)
    home = dict(headers)["Location"]
    assert status == 303 and home.startswith("/console/s/") and home.endswith("/")
    assert f"Path={home};" in dict(headers)["Set-Cookie"] + ";"
    cookie = {**host, "Cookie": dict(headers)["Set-Cookie"].split(";")[0]}
    status, _, page, _ = console.handle("GET", home, cookie, b"")
    assert status == 200 and f"href='{home}intent?id=charge%3A1'".encode() in page
    assert f'const BASE="{home[:-1]}"'.encode() in page
    for index in ("/console", "/console/"):
        status, _, page, _ = console.handle("GET", index, bearer, b"")
        assert status == 200 and b"href='/console/intent?id=charge%3A1'" in page
        assert b'const BASE="/console"' in page and b'fetch(BASE+"/api/intents"' in page
    status, _, page, _ = console.handle("GET", "/console/intent?id=charge%3A1", bearer, b"")
    assert b"href='/console/'" in page and b'fetch(BASE+"/api/clear"' in page
    assert console.handle("GET", "/console/api/stats", bearer, b"")[0] == 200
    with pytest.raises(ValueError):
        Console(fence, base="/console/")
    assert allowed_names("0.0.0.0", ["fence.internal:8443", "[fd00::1]:80", "ops"]) == (
        "fence.internal",
        "[fd00::1]",
        "ops",
    )
    assert allowed_names("10.0.0.5") == ("10.0.0.5",) and allowed_names("127.0.0.1") == ()


def test_payloads_shown_only_when_asked(fence: EffectFence) -> None:
    t = fence.prepare(req(1)).ticket  # type: ignore[union-attr]
    fence.commit(t, {"receipt": SECRET})
    for show, expect in ((False, False), (True, True)):
        server = serve(fence, show_payload=show)
        server.start(every=5.0)
        try:
            _, _, page = call(server.url + "/intent?id=charge%3A1")
            _, _, api = call(server.url + "/api/intent?id=charge%3A1")
            assert (SECRET.encode() in page) is expect and (SECRET.encode() in api) is expect
            assert b"BROKEN" not in page and b"id=chain>OK" in page
        finally:
            server.stop()


# -- the browser -----------------------------------------------------------------------------------


def _install_chromium() -> str | None:
    """Install Debian's chromium and its driver if missing; None if they run, else why not."""
    if shutil.which("chromium") and shutil.which("chromedriver"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "chromium/chromedriver missing (apt-get install chromium chromium-driver, as root)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-q"],
        ["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"],
    ):
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if done.returncode:
            return f"{' '.join(cmd)} failed: {done.stderr.strip()[-500:]}"
    return None if shutil.which("chromedriver") else "chromedriver still missing after install"


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    why = _install_chromium()
    webdriver: Any = None
    if why is None:
        try:
            from selenium import webdriver
        except ImportError as exc:
            why = f"selenium is not installed ({exc}): pip install -e '.[test]'"
    if why is not None:
        if REQUIRE:
            pytest.fail(f"{why}; EFFECTFENCE_REQUIRE_SERVICES=1 makes this a failure")
        pytest.skip(why)
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="effectfence-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1100,1000",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_console_in_a_browser(fence: EffectFence, console: ConsoleServer, browser: Any) -> None:
    """Open the page, see a failed intent appear after one aborts, clear it with a reason,
    see it gone and the audit entry present."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(browser, 15)
    row = (By.CSS_SELECTOR, "#intents tr[data-intent='charge:1']")
    browser.get(console.url + "/")
    wait.until(ec.presence_of_element_located((By.ID, "intents")))
    assert browser.find_elements(*row) == []

    fence.abort(fence.prepare(req(1)).ticket, "bank timeout")  # type: ignore[union-attr]
    fence.prepare(req(2))  # one in flight, to sit beside it
    wait.until(ec.text_to_be_present_in_element(row, "failed"))  # live update: no reload
    assert "bank timeout" in browser.find_element(*row).text
    wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#chart polyline"))
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "console-failed.png"))

    _click_live(browser, "charge:1")
    wait.until(ec.presence_of_element_located((By.ID, "clear-form")))
    assert SECRET not in browser.page_source
    browser.find_element(By.ID, "clear").click()  # no reason: the form does not go
    assert browser.find_element(By.ID, "result").text == ""
    assert fence.intent_status("charge:1").state == "failed"
    browser.find_element(By.ID, "reason").send_keys("refunded by hand, ticket #81")
    browser.find_element(By.ID, "clear").click()
    wait.until(ec.text_to_be_present_in_element((By.ID, "result"), "cleared: audit #"))
    assert fence.intent_status("charge:1").state == "absent"

    browser.get(console.url + "/")
    wait.until(ec.text_to_be_present_in_element((By.ID, "audit"), "refunded by hand, ticket #81"))
    wait.until(lambda d: not d.find_elements(*row))
    assert browser.find_elements(By.CSS_SELECTOR, "#intents tr[data-intent='charge:2']")
    audit = browser.find_element(By.ID, "audit").text
    assert "tester (console)" in audit and "failed" in audit
    shot = ARTIFACTS / "console.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 0
    print(f"\nscreenshot: {shot}")


# -- the console on the MCP server, in a browser -------------------------------------------------

AGENT_TOKEN = "billing-bot-token-0123456789abcdef"


def _mcp_calls(url: str, *calls: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Call the server's tools over streamable HTTP (the mcp SDK), as the agent principal;
    ``"$prepared"`` in arguments is the previous answer's ticket."""

    async def run() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        async with http_session(url, AGENT_TOKEN) as session:
            for tool, arguments in calls:
                if arguments.get("prepared") == "$prepared":
                    arguments = {**arguments, "prepared": out[-1]["prepared"]}
                result = await session.call_tool(tool, arguments)
                assert not result.is_error, result.content
                assert result.structured_content is not None
                out.append(result.structured_content)
        return out

    return anyio.run(run)


def _click_live(browser: Any, link_text: str) -> None:
    """Click a link in the live intents table. The page re-renders the table on every poll,
    so a link found may be replaced before the click lands (a stale element): find it
    again and click the new one, until one click gets through."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def click(d: Any) -> bool:
        d.find_element(By.LINK_TEXT, link_text).click()
        return True

    WebDriverWait(browser, 20, ignored_exceptions=(StaleElementReferenceException,)).until(click)


def _polyline_ys(browser: Any, series: str) -> list[float]:
    from selenium.webdriver.common.by import By

    line = browser.find_element(By.CSS_SELECTOR, f"#chart polyline[data-series='{series}']")
    return [float(p.split(",")[1]) for p in line.get_attribute("points").split()]


def test_console_on_the_mcp_server_in_a_browser(browser: Any, tmp_path: Path) -> None:
    """``effectfence serve --http --console --tokens``: log in with a token, watch a real
    MCP client's prepares and commits move the chart's fence_stats series, then clear the
    intent it aborted from the page, with a reason recorded under the operator's name."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    tokens = tmp_path / "tokens"
    tokens.write_text(f"ops {TOKEN}\nbilling-bot {AGENT_TOKEN}\n")
    tokens.chmod(0o600)
    argv = [sys.executable, "-m", "effectfence", "serve", "--http", "127.0.0.1:0"]
    argv += ["--console", "--tokens", str(tokens), "--allow-clear"]
    with spawn_http_server(argv) as srv:
        wait = WebDriverWait(browser, 20)
        browser.get(srv.base + "/console/")
        token = wait.until(ec.presence_of_element_located((By.NAME, "token")))
        assert browser.current_url == srv.base + "/console/login"
        token.send_keys(TOKEN)
        token.submit()
        wait.until(ec.text_to_be_present_in_element((By.TAG_NAME, "body"), "signed in as ops"))
        legend = (By.ID, "legend")
        wait.until(ec.text_to_be_present_in_element(legend, "admitted 0"))

        charge = {"domain": "order:1", "tool": "charge", "args": {"card": SECRET}}
        answers = _mcp_calls(
            srv.url,
            ("fence_prepare", {"intent": "charge:1", **charge}),
            ("fence_commit", {"prepared": "$prepared", "result": {"charge": "ch_1"}}),
            ("fence_prepare", {"intent": "charge:1", **charge}),
            ("fence_prepare", {"intent": "charge:2", **charge}),
            ("fence_abort", {"prepared": "$prepared", "reason": "bank timeout"}),
            ("fence_stats", {}),
        )
        assert answers[2]["status"] == "replay"
        stats = answers[-1]
        assert stats["prepare"]["admitted"] == 2 and stats["events"]["commits"] == 1
        # the chart follows the server's own counters: no reload, the page polls
        for shown in ("admitted 2", "commits 1", "replayed 1", "aborts 1", "attempts 3"):
            wait.until(ec.text_to_be_present_in_element(legend, shown))
        for series in ("admitted", "commits"):
            ys = _polyline_ys(browser, series)
            assert ys[0] > ys[-1], (series, ys)  # it rose from 0 (SVG y grows downwards)
        row = (By.CSS_SELECTOR, "#intents tr[data-intent='charge:2']")
        wait.until(ec.text_to_be_present_in_element(row, "failed"))
        assert SECRET not in browser.page_source
        ARTIFACTS.mkdir(exist_ok=True)
        browser.save_screenshot(str(ARTIFACTS / "console-serve-chart.png"))

        _click_live(browser, "charge:2")
        wait.until(ec.presence_of_element_located((By.ID, "clear-form")))
        assert re.match(
            re.escape(srv.base) + r"/console/s/[\w-]+/intent\?id=", browser.current_url
        ), browser.current_url
        browser.find_element(By.ID, "reason").send_keys("the bank shows no charge; ticket #82")
        browser.find_element(By.ID, "clear").click()
        wait.until(ec.text_to_be_present_in_element((By.ID, "result"), "by ops (console)"))
        [status] = _mcp_calls(srv.url, ("fence_status", {"intent": "charge:2"}))
        assert status["state"] == "absent"

        browser.find_element(By.PARTIAL_LINK_TEXT, "all intents").click()
        audit = (By.ID, "audit")
        wait.until(ec.text_to_be_present_in_element(audit, "the bank shows no charge; ticket #82"))
        wait.until(lambda d: not d.find_elements(*row))
        assert "ops (console)" in browser.find_element(*audit).text
        wait.until(ec.text_to_be_present_in_element(legend, "clears 1"))
        shot = ARTIFACTS / "console-serve.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 0
        print(f"\nscreenshot: {shot}")


def _page_data(con: Console, intent: str) -> dict[str, Any]:
    """What an intent's page hands its script (``const D=...``): the clear posts it back."""
    status, _, page, _ = con.handle(
        "GET", "/intent?id=" + urllib.parse.quote(intent, safe=""), {"Host": "127.0.0.1:1"}, b""
    )
    assert status == 200
    text = page.decode()
    start = text.index("const D=") + len("const D=")
    data: dict[str, Any] = json.loads(text[start : text.index(";\n", start)])
    return data


def _clear_as_the_page(con: Console, d: dict[str, Any], reason: str, force: bool) -> int:
    """The POST the page's script makes when the operator presses clear."""
    body = {
        "intent": d["intent"],
        "reason": reason,
        "force": force,
        "expect_state": d["state"],
        "expect_token": d["token"],
    }
    hdr = {"Host": "127.0.0.1:1", CSRF_HEADER: d["csrf"], "Origin": "http://127.0.0.1:1"}
    status, _, _, _ = con.handle("POST", "/api/clear", hdr, json.dumps(body).encode())
    return status


def test_a_clear_from_the_page_clears_only_the_record_the_page_showed() -> None:
    """The page showed one attempt; the clear posts its state and token back, and a record
    that moved since is refused (409), untouched. Found by review: with only the intent
    named, a forced clear meant for a dead holder hit the lease another agent had taken
    over since (it was running the effect: a retry could run it again), and a clear meant
    for one failure removed a newer one nobody had reconciled."""
    from support import FakeClock

    from effectfence.store.memory import MemoryStore

    clock = FakeClock()
    fence = EffectFence(
        FenceConfig(lease_ttl=10.0, auto_sweep=False), store=MemoryStore(clock=clock)
    )
    con = Console(fence, who="ops")
    first = fence.prepare(EffectRequest("charge:1", "o", "charge", {"n": 1}, "agent-a")).ticket
    shown = _page_data(con, "charge:1")
    assert (shown["state"], shown["token"]) == ("in_flight", first.token)  # type: ignore[union-attr]
    clock.advance(11.0)  # agent-a's lease lapses; agent-b takes over and is running it
    second = fence.prepare(EffectRequest("charge:1", "o", "charge", {"n": 1}, "agent-b")).ticket
    assert _clear_as_the_page(con, shown, "agent-a's host is dead", force=True) == 409
    assert fence.record("charge:1")[0].token == second.token  # type: ignore[union-attr]
    # a failure shown, then cleared by someone else, retried and failed again
    fence.abort(second, "bank timeout")  # type: ignore[arg-type]
    shown = _page_data(con, "charge:1")
    assert shown["state"] == "failed"
    fence.clear("charge:1", reason="reconciled", who="bob")
    retry = fence.prepare(EffectRequest("charge:1", "o", "charge", {"n": 1}, "agent-a")).ticket
    fence.abort(retry, "gateway 502")  # type: ignore[arg-type]
    assert _clear_as_the_page(con, shown, "refunded the bank timeout", force=False) == 409
    assert fence.record("charge:1")[0].reason == "gateway 502"  # type: ignore[union-attr]
    # the page as it is now clears
    assert _clear_as_the_page(con, _page_data(con, "charge:1"), "refunded", force=False) == 200
    assert fence.record("charge:1")[0] is None
