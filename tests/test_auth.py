"""The access token beyond loopback (webapp.security), in-process and through the real CLI.

In-process: the real app with a scripted engine, configured as `serve --host 0.0.0.0` would configure
it; the page, static files, the websocket and /v1 refuse a request without the token (even one that
claims loopback in its Host header and client address) and accept it by query (then a cookie),
cookie or bearer; the CSRF, Origin and Host checks still apply; a loopback server needs no token.
The real CLI: `flashcode serve --host 0.0.0.0 --port 0` prints a URL with a token and answers 401
without it (connecting only to 127.0.0.1).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from engine.worker import Worker
from tests.servers import serve_cli
from tests.test_openai_api import FakeEngine
from tests.test_ws import send, until
from webapp import security
from webapp.app import create_app
from webapp.settings import Settings

TOKEN = "a-test-token-0123456789"
BASE = "http://127.0.0.1:8000"
ORIGIN = BASE
COOKIE = "flashcode_token_8000"


def make_client(
    tmp_path: Path, client: tuple[str, int] = ("127.0.0.1", 50000), **settings: object
) -> Iterator[TestClient]:
    worker = Worker(lambda: FakeEngine(context_length=4096))
    app = create_app(Settings(data_dir=tmp_path, load_model=False, **settings), worker=worker)  # type: ignore[arg-type]
    with TestClient(app, base_url=BASE, client=client) as c:
        yield c
    worker.close()


@pytest.fixture
def remote(tmp_path: Path) -> Iterator[TestClient]:
    """As `flashcode serve --host 0.0.0.0 --token TOKEN` builds it; the request claims loopback."""
    yield from make_client(tmp_path, host="0.0.0.0", token=TOKEN)


@pytest.fixture
def local(tmp_path: Path) -> Iterator[TestClient]:
    yield from make_client(tmp_path)


def ws_connect(client: TestClient, query: str = "", origin: str = ORIGIN):
    return client.websocket_connect(f"ws://127.0.0.1:8000/ws{query}", headers={"origin": origin})


def chat(client: TestClient, **headers: str) -> httpx.Response:
    return client.post(
        "/v1/chat/completions", headers=headers, json={"messages": [{"role": "user", "content": "hello"}]}
    )


# --------------------------------------------------------------------------- refused without the token
@pytest.mark.parametrize("path", ["/", "/health", "/conversations", "/static/app.js", "/c/abc/export.md"])
def test_auth_refuses_every_page_without_the_token(remote: TestClient, path: str) -> None:
    r = remote.get(path)
    assert r.status_code == 401, (path, r.status_code)
    assert "needs its access token" in r.text and "?token=" in r.text
    assert r.headers["www-authenticate"].startswith("Bearer")
    assert r.headers["x-frame-options"] == "DENY"  # the security headers are on refusals too


def test_auth_refuses_a_wrong_token_with_403(remote: TestClient) -> None:
    assert remote.get("/?token=wrong-token-000", follow_redirects=False).status_code == 403
    assert remote.get("/", headers={"authorization": "Bearer wrong-token-000"}).status_code == 403
    remote.cookies.set(COOKIE, "wrong-token-000")
    r = remote.get("/")
    assert r.status_code == 403 and "wrong access token" in r.text


def test_auth_websocket_closes_with_policy_violation_before_accept(remote: TestClient) -> None:
    with pytest.raises(WebSocketDisconnect) as info, ws_connect(remote):
        pass
    assert info.value.code == 1008 and "access token" in info.value.reason
    with pytest.raises(WebSocketDisconnect) as info, ws_connect(remote, "?token=wrong-token-000"):
        pass
    assert info.value.code == 1008


def test_auth_v1_refuses_without_bearer_in_openai_shape(remote: TestClient) -> None:
    for r in (remote.get("/v1/models"), chat(remote), chat(remote, authorization="Bearer wrong-token-000")):
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"


# --------------------------------------------------------------------------- accepted with it
def test_auth_query_token_becomes_a_strict_cookie_and_a_clean_url(remote: TestClient) -> None:
    r = remote.get(f"/?token={TOKEN}&x=1", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/?x=1"
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{COOKIE}={TOKEN};")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    page = remote.get("/")  # the client kept the cookie, as a browser does
    assert page.status_code == 200 and 'id="chat-window"' in page.text
    assert TOKEN not in page.text  # the page never carries the token (scripts could read it)
    assert remote.get("/static/app.js").status_code == 200
    assert remote.get("/c/nope").status_code == 404  # past the token check, to the handler


def test_auth_websocket_works_with_the_cookie_or_query(remote: TestClient) -> None:
    remote.get(f"/?token={TOKEN}", follow_redirects=False)
    with ws_connect(remote) as ws:
        send(ws, type="send", text="hello", conversation_id="")
        frames = until(ws, r'data-state="idle"')
    assert "Hi" in "".join(frames)
    remote.cookies.clear()
    with ws_connect(remote, f"?token={TOKEN}") as ws:
        send(ws, type="send", text="again", conversation_id="")
        until(ws, r'data-state="idle"')


def test_auth_v1_accepts_the_bearer_from_any_client(tmp_path: Path) -> None:
    for c in make_client(tmp_path, client=("203.0.113.9", 40000), host="0.0.0.0", token=TOKEN):
        r = chat(c, authorization=f"Bearer {TOKEN}")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "Hi there!"
        assert c.get("/v1/models", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_auth_openai_client_uses_the_token_as_api_key(remote: TestClient) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key=TOKEN, http_client=remote)
    assert (
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
        .choices[0]
        .message.content
        == "Hi there!"
    )
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{BASE}/v1", api_key="wrong-token-000", http_client=remote).models.list()


# --------------------------------------------------------------------------- the other checks still hold
def test_auth_token_does_not_replace_csrf_origin_or_host_checks(remote: TestClient) -> None:
    remote.get(f"/?token={TOKEN}", follow_redirects=False)
    r = remote.post("/c/abc/rename", data={"title": "x"})
    assert r.status_code == 403 and "CSRF" in r.text
    with pytest.raises(WebSocketDisconnect) as info, ws_connect(remote, origin="http://evil.example"):
        pass
    assert info.value.code == 1008 and info.value.reason == "origin not allowed"
    assert remote.get("/", headers={"host": "evil.example"}).status_code == 400  # DNS rebinding
    r = remote.post(
        "/v1/chat/completions",
        headers={"origin": "http://evil.example"},
        json={"messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 403 and "evil.example" in r.json()["error"]["message"]


def test_auth_clean_url_stays_on_this_server() -> None:
    from starlette.requests import HTTPConnection

    scope = {
        "type": "http",
        "method": "GET",
        "path": "//evil.example/x",
        "query_string": f"token={TOKEN}".encode(),
        "headers": [(b"host", b"127.0.0.1:8000")],
        "scheme": "http",
        "server": ("127.0.0.1", 8000),
    }
    r = security.TokenMiddleware(lambda *a: None, TOKEN, 8000).clean_url(HTTPConnection(scope))  # type: ignore[arg-type]
    assert r.status_code == 303 and r.headers["location"] == "/evil.example/x"  # not //evil.example


def test_auth_cookie_belongs_to_one_port(remote: TestClient) -> None:
    remote.cookies.set("flashcode_token_9000", TOKEN)  # another flashcode on this host
    assert remote.get("/").status_code == 401


# --------------------------------------------------------------------------- loopback and configuration
def test_auth_loopback_needs_no_token(local: TestClient) -> None:
    assert local.get("/").status_code == 200
    assert local.get("/v1/models").status_code == 200
    with ws_connect(local) as ws:
        send(ws, type="send", text="hello", conversation_id="")
        until(ws, r'data-state="idle"')


def test_auth_a_token_given_on_loopback_is_required(tmp_path: Path) -> None:
    for c in make_client(tmp_path, token=TOKEN):
        assert c.get("/").status_code == 401
        assert c.get("/", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200


def test_auth_beyond_loopback_without_a_token_fails_closed(tmp_path: Path) -> None:
    for c in make_client(tmp_path, host="0.0.0.0"):
        token = c.app.state.settings.token
        assert token and len(token) >= 32
        assert c.get("/").status_code == 401
        assert c.get("/", headers={"authorization": f"Bearer {token}"}).status_code == 200


def test_auth_loopback_bind_behind_a_proxy_for_another_host_asks_for_the_token(tmp_path: Path) -> None:
    """`--allow-origin https://flash.example.com` on a loopback bind: a reverse proxy there forwards
    everyone's requests from 127.0.0.1, so the app asks for its token as if bound beyond loopback."""
    proxied = {"host": "flash.example.com", "origin": "https://flash.example.com"}
    for c in make_client(tmp_path, extra_origins=("https://flash.example.com",)):
        token = c.app.state.settings.token
        assert token and len(token) >= 32
        assert c.get("/", headers=proxied).status_code == 401
        assert c.get("/v1/models", headers=proxied).status_code == 401
        with pytest.raises(WebSocketDisconnect):
            with c.websocket_connect("ws://flash.example.com/ws", headers=proxied):
                pass
        assert c.get("/", headers={**proxied, "authorization": f"Bearer {token}"}).status_code == 200
    assert Settings(extra_origins=("http://localhost:5173",)).local_only  # a page on this machine: no token
    assert not Settings(extra_origins=("http://localhost:5173", "https://flash.example.com")).local_only


def test_auth_resolve_token_order_and_checks() -> None:
    env = {security.TOKEN_ENV: "from-the-environment"}
    assert security.resolve_token("given-on-the-cli", loopback=False, env=env) == "given-on-the-cli"
    assert security.resolve_token(None, loopback=False, env=env) == "from-the-environment"
    assert security.resolve_token(None, loopback=True, env={}) is None
    a, b = (security.resolve_token(None, loopback=False, env={}) for _ in range(2))
    assert a and b and a != b and len(a) >= 32
    with pytest.raises(ValueError, match="8 or more"):
        security.resolve_token("short", loopback=False, env={})
    with pytest.raises(ValueError, match="only letters, digits"):
        security.resolve_token("has spaces; and=", loopback=False, env={})


def test_auth_loopback_is_where_the_server_is_bound() -> None:
    assert Settings(host="127.0.0.1").is_loopback and Settings(host="::1").is_loopback
    assert Settings(host="localhost").is_loopback and Settings(host="127.0.0.2").is_loopback
    assert not Settings(host="0.0.0.0").is_loopback and not Settings(host="192.168.1.5").is_loopback


# --------------------------------------------------------------------------- the real CLI
FLASHCODE = [sys.executable, "-m", "webapp.cli"]


def test_auth_serve_refuses_a_short_token() -> None:
    proc = subprocess.run(
        [*FLASHCODE, "serve", "--host", "0.0.0.0", "--token", "abc"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.endswith(
        "the access token is 3 characters long: use 8 or more (or leave --token and "
        "$FLASHCODE_TOKEN unset for a random one)\n"
    )


@pytest.fixture
def remote_server(data_dir: Path) -> Iterator[tuple[str, str, int]]:
    """`flashcode serve --host 0.0.0.0 --port 0` for real; yields (printed URL, token, port)."""
    env = {k: v for k, v in os.environ.items() if k != security.TOKEN_ENV}
    with serve_cli(data_dir, "--host", "0.0.0.0", "--data-dir", str(data_dir), env=env) as served:
        parts = urlsplit(served.url)
        assert parts.hostname == "127.0.0.1" and parts.port and parts.port > 0, served.url
        yield served.url, parse_qs(parts.query)["token"][0], parts.port


@pytest.mark.slow
def test_auth_real_serve_beyond_loopback_prints_a_token_url_and_refuses_without_it(
    remote_server: tuple[str, str, int],
) -> None:
    url, token, port = remote_server
    assert len(token) >= 32
    base = f"http://127.0.0.1:{port}"
    r = httpx.get(f"{base}/health", timeout=30)  # the server listens once the URL is printed
    assert r.status_code == 401 and "access token" in r.text
    assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 401
    with httpx.Client(follow_redirects=True, timeout=30) as browser:  # keeps cookies, as a browser
        r = browser.get(url)  # the printed URL: redirect, cookie, the page
        assert browser.get(f"{base}/static/app.js").status_code == 200
    assert r.status_code == 200 and 'id="chat-window"' in r.text
    assert r.history[0].status_code == 303 and f"flashcode_token_{port}" in r.history[0].headers["set-cookie"]
    health = httpx.get(f"{base}/health", headers={"authorization": f"Bearer {token}"}, timeout=30).json()
    assert health["model"] == "smollm2-135m-instruct-q4_1"
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    with pytest.raises(InvalidStatus) as info:
        connect(f"ws://127.0.0.1:{port}/ws", origin=base, open_timeout=30).close()
    assert info.value.response.status_code == 403
    with connect(
        f"ws://127.0.0.1:{port}/ws",
        origin=base,
        open_timeout=30,
        additional_headers={"cookie": f"flashcode_token_{port}={token}"},
    ):
        pass


@pytest.mark.slow
@pytest.mark.browser
def test_auth_real_browser_opens_the_token_url_and_chats(remote_server: tuple[str, str, int]) -> None:
    """Chromium follows the printed URL: the token leaves the address bar, page scripts cannot read
    it, and the websocket (sent the cookie by the browser) streams a reply."""
    chromium = "/usr/bin/chromium"
    if not Path(chromium).exists():
        pytest.skip("Chromium is not installed (make test installs it)")
    from playwright.sync_api import sync_playwright

    url, token, port = remote_server
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=chromium, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        page = browser.new_page()
        page.goto(url)
        assert page.url == f"http://127.0.0.1:{port}/"
        page.wait_for_function("() => document.querySelector('#model-picker') && window.htmx")
        assert token not in page.evaluate("document.cookie")
        page.fill("#prompt", "Hi")
        page.press("#prompt", "Enter")
        page.wait_for_function(
            "() => (document.querySelector('.msg-assistant .body')?.textContent || '').length > 0",
            timeout=90_000,
        )
        page.keyboard.press("Escape")
        page.wait_for_selector("#status[data-state=idle]", timeout=10_000)
        stranger = browser.new_page()  # no cookie: refused
        assert stranger.goto(f"http://127.0.0.1:{port}/").status == 401
        browser.close()
