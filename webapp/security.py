"""Who may talk to this server, checked once for every request: the access token, trusted Host
names, the Origin and CSRF rule, and the security headers. Handlers never check these themselves.

The token. A server bound to loopback (127.0.0.1, ::1, localhost) is reachable from this machine
only and needs no token. Bound anywhere else (`flashcode serve --host 0.0.0.0`), every request —
the page, static files, the websocket, `/v1` — must carry the server's token, as Jupyter does:
`?token=` in the URL (answered with an HttpOnly, SameSite=Strict cookie and a redirect to the clean
URL, so the token leaves the address bar), that cookie, or `Authorization: Bearer TOKEN` (OpenAI
clients send their `api_key` so). A token given with `--token` or `$FLASHCODE_TOKEN` is required
even on loopback. "Loopback" is where the server is bound, never what a request's Host header or
client address claims. Tokens are compared with `secrets.compare_digest`.

Cross-site requests (`CsrfMiddleware`). The websocket handshake must come from one of the app's own
origins (checked before `accept()`: `CORSMiddleware` does not cover websockets). A state-changing
request (POST, PUT, PATCH, DELETE) must carry the per-process CSRF token — header `X-CSRF-Token`,
which the page puts in `hx-headers`, or a `csrf_token` form field in a small form body — and, when
it has an Origin header, an allowed Origin. `/v1` (OpenAI clients send no CSRF token) is held to
the Origin part only, on every method. Another site cannot read the token: there is no CORS header
anywhere.

What is not here: the `/v1` loopback/API-key rule (`webapp.api.openai.check_access`), which a
request that passed the token check skips.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
from collections.abc import Mapping
from urllib.parse import urlencode, urlsplit

from starlette.datastructures import URL, Headers
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import HTTPConnection, Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .settings import WILDCARD_HOSTS, Settings, url_host

log = logging.getLogger(__name__)

TOKEN_ENV = "FLASHCODE_TOKEN"
QUERY_PARAM = "token"
AUTHENTICATED = "flashcode.token_ok"  # set in the ASGI scope once the token matched
TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~-]+")
CSRF_HEADER = "x-csrf-token"
CSRF_FIELD = "csrf_token"
UNSAFE_METHODS = {"POST", "PUT", "PATCH", "DELETE"}
MAX_FORM_BYTES = 1 << 20  # a csrf_token form field is read from bodies up to this size only

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
        "font-src 'self'; connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
        "form-action 'self'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
}


# --------------------------------------------------------------------------- hosts
def allowed_hosts(settings: Settings) -> list[str]:
    """The Host names a request may carry; an IPv6 address both bare and as a browser sends it, `[::1]`
    (Starlette compares the Host header without its port, brackets kept)."""
    names = {urlsplit(o).hostname or "" for o in settings.allowed_origins} - {""}
    return sorted(names | {f"[{n}]" for n in names if ":" in n})


# --------------------------------------------------------------------------- the token
def new_token() -> str:
    return secrets.token_urlsafe(32)


def resolve_token(given: str | None, loopback: bool, env: Mapping[str, str] = os.environ) -> str | None:
    """--token, else $FLASHCODE_TOKEN, else a fresh random one when bound beyond loopback."""
    token = given or env.get(TOKEN_ENV) or None
    if token is not None and len(token) < 8:
        raise ValueError(
            f"the access token is {len(token)} characters long: use 8 or more (or leave "
            f"--token and ${TOKEN_ENV} unset for a random one)"
        )
    if token is not None and not TOKEN_CHARS.fullmatch(token):
        raise ValueError(
            "the access token may hold only letters, digits and . _ ~ - (it travels in URLs "
            f"and cookies): change --token or ${TOKEN_ENV}"
        )
    return token or (None if loopback else new_token())


def token_matches(given: str | None, token: str) -> bool:
    return bool(given) and secrets.compare_digest(str(given).encode(), token.encode())


def cookie_name(port: int) -> str:
    return f"flashcode_token_{port}"  # browsers share cookies across ports: one per server


def authenticated(scope: Scope) -> bool:
    """Whether the token check let this request in because it carried the token."""
    return bool(scope.get(AUTHENTICATED))


def token_urls(host: str, port: int, token: str | None) -> list[str]:
    """The URLs to print for a server: loopback first; a wildcard bind adds this machine's name."""
    query = f"/?{urlencode({QUERY_PARAM: token})}" if token else ""
    hosts = ["127.0.0.1", socket.gethostname()] if host in WILDCARD_HOSTS else [host]
    return [f"http://{url_host(h)}:{port}{query}" for h in hosts]


REFUSED_HINT = (
    "open the URL that `flashcode serve` printed (it ends in ?token=...), or send the header "
    "'Authorization: Bearer TOKEN'"
)


class TokenMiddleware:
    """Lets a request through only with the token (query, cookie or bearer); see the module doc."""

    def __init__(self, app: ASGIApp, token: str, port: int) -> None:
        self.app, self.token, self.cookie = app, token, cookie_name(port)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        conn = HTTPConnection(scope)
        in_query = conn.query_params.get(QUERY_PARAM)
        offered = [in_query, conn.cookies.get(self.cookie), bearer(conn.headers)]
        if not any(token_matches(t, self.token) for t in offered):
            return await self.refuse(scope, receive, send, wrong=any(offered))
        if in_query is not None and scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
            return await self.clean_url(conn)(scope, receive, send)
        scope[AUTHENTICATED] = True
        await self.app(scope, receive, send)

    def clean_url(self, conn: HTTPConnection) -> Response:
        """The token moves from the address bar into a cookie the page's scripts cannot read."""
        rest = [(k, v) for k, v in conn.query_params.multi_items() if k != QUERY_PARAM]
        path = "/" + conn.url.path.lstrip("/")  # never "//host/...": that would leave this server
        target = path + (f"?{urlencode(rest)}" if rest else "")
        response = RedirectResponse(target, status_code=303)  # relative: the Host header is not trusted
        response.set_cookie(self.cookie, self.token, httponly=True, samesite="strict", path="/")
        return response

    async def refuse(self, scope: Scope, receive: Receive, send: Send, wrong: bool) -> None:
        what = "wrong access token" if wrong else "this flashcode server needs its access token"
        message = f"{what}: {REFUSED_HINT}"
        if scope["type"] == "websocket":  # before accept: the handshake is answered with 403
            await send({"type": "websocket.close", "code": 1008, "reason": what})
            return
        api = URL(scope=scope).path.startswith("/v1/")
        status = 403 if wrong and not api else 401  # OpenAI clients expect 401 for a wrong key
        response: Response
        if api:  # OpenAI clients read {"error": {...}}
            body = {
                "error": {
                    "message": message,
                    "type": "authentication_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            }
            response = JSONResponse(body, status_code=status)
        else:
            response = PlainTextResponse(f"{status}: {message}", status_code=status)
        response.headers["www-authenticate"] = 'Bearer realm="flashcode"'
        await response(scope, receive, send)


def bearer(headers: Headers) -> str | None:
    scheme, _, value = headers.get("authorization", "").partition(" ")
    return (value.strip() or None) if scheme.lower() == "bearer" else None


# --------------------------------------------------------------------------- headers
class SecurityHeaders:
    """A strict Content-Security-Policy and friends on every response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                headers += [
                    (k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items() if k.encode() not in names
                ]
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, with_headers)


class MaskToken(logging.Filter):
    """Log lines (uvicorn's access log) show `?token=…`, never the token: a terminal's scrollback or a
    copied log must not hand out access."""

    PATTERN = re.compile(r"((?:^|[?&])" + QUERY_PARAM + r"=)[^&\s\"]*")

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(self.PATTERN.sub(r"\1…", a) if isinstance(a, str) else a for a in record.args)
        if isinstance(record.msg, str):
            record.msg = self.PATTERN.sub(r"\1…", record.msg)
        return True


def with_security_headers(response: Response) -> Response:
    """`response` with the headers `SecurityHeaders` adds, for an answer made outside it (a 500, which
    Starlette's outermost error middleware writes)."""
    for k, v in SECURITY_HEADERS.items():
        response.headers.setdefault(k, v)
    return response


# --------------------------------------------------------------------------- cross-site requests
class CsrfMiddleware:
    """The Origin of the websocket and of `/v1`, and token + Origin on every other change (module doc)."""

    def __init__(self, app: ASGIApp, token: str, allowed_origins: set[str]) -> None:
        self.app, self.token, self.allowed = app, token, set(allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        conn = HTTPConnection(scope)
        origin = conn.headers.get("origin")
        if scope["type"] == "websocket":
            if origin not in self.allowed:  # a missing Origin too: browsers always send one
                log.warning("websocket from origin %r refused", origin)
                return await send({"type": "websocket.close", "code": 1008, "reason": "origin not allowed"})
            return await self.app(scope, receive, send)
        api = conn.url.path.startswith("/v1/")
        if not api and scope["method"] not in UNSAFE_METHODS:
            return await self.app(scope, receive, send)
        if origin is not None and origin not in self.allowed:
            return await refusal(f"cross-origin request from {origin} refused", api)(scope, receive, send)
        if api:
            return await self.app(scope, receive, send)
        given = conn.headers.get(CSRF_HEADER)
        if given is None and _is_form(conn.headers):
            given, receive = await _form_token(scope, receive)
        if not token_matches(given, self.token):
            message = "missing or stale CSRF token: reload the page and try again"
            return await refusal(message, api)(scope, receive, send)
        await self.app(scope, receive, send)


def _is_form(headers: Headers) -> bool:
    return headers.get("content-type", "").startswith(("application/x-www-form", "multipart/"))


async def _form_token(scope: Scope, receive: Receive) -> tuple[str | None, Receive]:
    """The body's `csrf_token` field, and a `receive` that hands the app the body again."""
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None, receive
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
        if size > MAX_FORM_BYTES:  # a large upload sends the header (htmx does), not a form field
            return None, receive
    body = b"".join(chunks)
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    try:
        form = await Request(scope, replay).form()
    except Exception:  # noqa: BLE001 - a malformed body (bad multipart, too many fields): no token in it
        sent = False
        return None, replay
    value = form.get(CSRF_FIELD)
    await form.close()
    sent = False
    return (value if isinstance(value, str) else None), replay


def refusal(message: str, api: bool) -> Response:
    if api:  # OpenAI clients read {"error": {...}}
        body = {"error": {"message": message, "type": "permission_error", "param": None, "code": "forbidden"}}
        return JSONResponse(body, status_code=403)
    return PlainTextResponse(f"403: {message}", status_code=403)


# --------------------------------------------------------------------------- the stack
def middleware(settings: Settings, csrf_token: str) -> list[Middleware]:
    """Outermost first: headers on every answer, then the token, the Host check (DNS rebinding),
    then the Origin and CSRF rule."""
    if not settings.token and not settings.local_only:
        settings.token = new_token()  # fail closed: never serve beyond loopback without a token
    stack = [Middleware(SecurityHeaders)]
    if settings.token:
        stack.append(Middleware(TokenMiddleware, token=settings.token, port=settings.port))
    stack.append(Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(settings)))
    stack.append(Middleware(CsrfMiddleware, token=csrf_token, allowed_origins=settings.allowed_origins))
    return stack
