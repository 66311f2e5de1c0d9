"""Who may talk to this server, checked once for every request: the access token, trusted Host
names and the security headers. Handlers never check these themselves.

The token. A server bound to loopback (127.0.0.1, ::1, localhost) is reachable from this machine
only and needs no token. Bound anywhere else (`flashcode serve --host 0.0.0.0`), every request —
the page, static files, the websocket, `/v1` — must carry the server's token, as Jupyter does:
`?token=` in the URL (answered with an HttpOnly, SameSite=Strict cookie and a redirect to the clean
URL, so the token leaves the address bar), that cookie, or `Authorization: Bearer TOKEN` (OpenAI
clients send their `api_key` so). A token given with `--token` or `$FLASHCODE_TOKEN` is required
even on loopback. "Loopback" is where the server is bound, never what a request's Host header or
client address claims. Tokens are compared with `secrets.compare_digest`.

What is not here: the Origin and CSRF checks of state-changing routes (`routes.check_csrf`) and of
the websocket (`ws.origin_allowed`), and the `/v1` loopback/API-key rule (`openai_api.check_access`),
which a request that passed the token check skips.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import re
import secrets
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlencode, urlsplit

from starlette.datastructures import URL, Headers
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import HTTPConnection
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from .settings import Settings

log = logging.getLogger(__name__)

TOKEN_ENV = "FLASHCODE_TOKEN"
QUERY_PARAM = "token"
AUTHENTICATED = "flashcode.token_ok"  # set in the ASGI scope once the token matched
WILDCARD_HOSTS = {"0.0.0.0", "::", ""}
TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~-]+")

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
def is_loopback_host(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@functools.lru_cache(maxsize=1)
def local_host_names() -> frozenset[str]:
    """This machine's names and addresses: what a browser elsewhere may call a wildcard-bound server."""
    names = {socket.gethostname()}
    if "." not in socket.gethostname():
        names.add(f"{socket.gethostname()}.local")  # mDNS (macOS, avahi)
    try:
        import psutil

        for addrs in psutil.net_if_addrs().values():
            names.update(a.address for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6))
    except Exception as exc:  # noqa: BLE001 - no interface list: the names above still work
        log.debug("could not list network addresses: %s", exc)
    return frozenset(n for n in names if n and "%" not in n)  # no scoped (link-local) IPv6


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def allowed_hosts(settings: Settings) -> list[str]:
    return sorted({urlsplit(o).hostname or "" for o in settings.allowed_origins} - {""})


# --------------------------------------------------------------------------- the token
def new_token() -> str:
    return secrets.token_urlsafe(32)


def resolve_token(given: str | None, loopback: bool, env: Mapping[str, str] = os.environ) -> str | None:
    """--token, else $FLASHCODE_TOKEN, else a fresh random one when bound beyond loopback."""
    token = given or env.get(TOKEN_ENV) or None
    if token is not None and len(token) < 8:
        raise ValueError(f"the access token is {len(token)} characters long: use 8 or more (or leave "
                         f"--token and ${TOKEN_ENV} unset for a random one)")  # fmt: skip
    if token is not None and not TOKEN_CHARS.fullmatch(token):
        raise ValueError("the access token may hold only letters, digits and . _ ~ - (it travels in URLs "
                         f"and cookies): change --token or ${TOKEN_ENV}")  # fmt: skip
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
            body = {"error": {"message": message, "type": "authentication_error", "param": None,
                              "code": "invalid_api_key"}}  # fmt: skip
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


def middleware(settings: Settings) -> list[Middleware]:
    """Outermost first: headers on every answer, then the token, then the Host check (DNS rebinding)."""
    if not settings.token and not settings.is_loopback:
        settings.token = new_token()  # fail closed: never serve beyond loopback without a token
    stack = [Middleware(SecurityHeaders)]
    if settings.token:
        stack.append(Middleware(TokenMiddleware, token=settings.token, port=settings.port))
    stack.append(Middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts(settings)))
    return stack
