"""What the server refuses before a request reaches the API, so that no client can stall or drive it:

- connections: at most `max_connections` open, so file descriptors never run out: at the cap a new connection
  closes the oldest one that has not sent a whole request (or itself, when every one has a request in flight); and a
  request must arrive whole, headers and body, within `read_timeout_s` (slow or silent clients are dropped);
- bodies over `max_body_bytes` → 413, before any parsing. A connection closed while its request body is still
  arriving (a 413, a timeout) closes as nginx's lingering close does: FIN first, what the client still sends
  discarded for up to LINGER_S, so that a client in the middle of a large upload reads the answer, not a reset;
- POSTs to the API's POST routes that are not `application/json` → 415 (a web page cannot send JSON cross-origin
  without a preflight); other methods and paths go on to routing, which answers 405 or 404;
- a `Host` header the server was not bound for → 421 (DNS rebinding against a loopback server);
- with an API key, a /v1 request (and, if asked, /health and /metrics) without `Authorization: Bearer KEY` → 401.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spear.errors import SpearError

if TYPE_CHECKING:
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
LINGER_S = 2.0  # how long a closing connection keeps discarding a client's unread upload


@dataclass(frozen=True)
class GuardConfig:
    max_body_bytes: int = 4 * 2**20
    read_timeout_s: float = 30.0  # for a whole request (headers and body) to arrive
    max_connections: int = 1024
    allowed_hosts: tuple[str, ...] | None = None  # None: the bind address's names when loopback, else any; ("*",): any
    api_key: str | None = None  # bearer key every /v1 route requires (None: no auth)
    key_probes: bool = False  # /health and /metrics need the key too

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.read_timeout_s <= 0 or self.max_connections < 1:
            raise SpearError("--max-body-mb, --read-timeout-s and --max-connections must be positive")
        if self.api_key is not None and not self.api_key.strip():
            raise SpearError("--api-key (or SPEAR_API_KEY) is empty")
        if self.key_probes and self.api_key is None:
            raise SpearError("--api-key-probes needs --api-key (or SPEAR_API_KEY)")


def allowed_hosts(bind_host: str, guard: GuardConfig) -> frozenset[str] | None:
    """Host names (no port) a request may name; None: any."""
    if guard.allowed_hosts is not None:
        return None if "*" in guard.allowed_hosts else frozenset(h.lower() for h in guard.allowed_hosts)
    try:
        loopback = bind_host == "localhost" or ipaddress.ip_address(bind_host).is_loopback
    except ValueError:  # a host name: the user chose it, accept what clients call it
        loopback = False
    return frozenset(LOOPBACK_NAMES) | {bind_host.lower()} if loopback else None


def _host_name(header: str) -> str:
    """'example.com:8000' → 'example.com'; '[::1]:8000' → '::1'."""
    if header.startswith("["):
        return header[1:].split("]", 1)[0].lower()
    return header.rsplit(":", 1)[0].lower() if header.count(":") == 1 else header.lower()


def _replay(body: bytes, receive):
    """A receive() that hands over the body already read, then waits on the connection (for the disconnect)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class GuardMiddleware:
    """ASGI middleware: Host, API key, Content-Type and body-size checks, each answered with an OpenAI-style error."""

    def __init__(self, app, hosts: frozenset[str] | None, config: GuardConfig):
        self.app = app
        self.hosts = hosts
        self.max_body_bytes = config.max_body_bytes
        self.api_key = None if config.api_key is None else config.api_key.encode()
        self.key_probes = config.key_probes
        # the requests whose body the app reads: POSTs to these paths (the API's POST routes, none with parameters)
        self.body_paths = frozenset(route.path for route in app.routes if "POST" in route.methods)

    def _authorized(self, path: str, headers: dict[str, str]) -> bool:
        if self.api_key is None or not (path.startswith("/v1") or self.key_probes):
            return True
        scheme, _, key = headers.get("authorization", "").strip().partition(" ")
        # RFC 7235: the scheme is case-insensitive ("bearer" is "Bearer")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode("latin-1"), self.api_key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.hosts is not None and _host_name(headers.get("host", "")) not in self.hosts:
            return await _refuse(send, 421, f"the Host header {headers.get('host', '')!r} is not one this server "
                                            "answers to (spear serve --allowed-hosts)")
        if not self._authorized(scope["path"], headers):
            return await _refuse(send, 401, "a valid API key is required: send Authorization: Bearer KEY",
                                 code="invalid_api_key", extra=[(b"www-authenticate", b"Bearer")])
        if scope["method"] == "POST" and scope["path"] in self.body_paths:
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                return await _refuse(send, 415, "the request body must be JSON, sent with Content-Type: application/json")
            length = headers.get("content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
                return await _refuse(send, 413, self._too_large())
            body = bytearray()  # read whole (FastAPI would too), so that an oversized one never reaches the app
            while True:
                message = await receive()
                if message["type"] != "http.request":  # the client left
                    return
                body += message.get("body", b"")
                if len(body) > self.max_body_bytes:
                    return await _refuse(send, 413, self._too_large())
                if not message.get("more_body", False):
                    break
            receive = _replay(bytes(body), receive)
        await self.app(scope, receive, send)

    def _too_large(self) -> str:
        return f"the request body is over {self.max_body_bytes} bytes (spear serve --max-body-mb)"


async def _refuse(send, status: int, message: str, code: str | None = None, extra: list | None = None) -> None:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": code}}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *(extra or [])]})
    await send({"type": "http.response.body", "body": body})


class LingeringTransport:
    """An asyncio transport whose close() half-closes first while the client is still sending its request: closing a
    socket with unread input sends a reset, which can reach the client before it reads the response. So send FIN, keep
    reading (the protocol drops what arrives), and close for good when the client does or after `seconds`."""

    def __init__(self, transport, loop, client_still_sending: Callable[[], bool], seconds: float = LINGER_S):
        self._transport = transport
        self._loop = loop
        self._client_still_sending = client_still_sending
        self._seconds = seconds
        self.lingering = False

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self._transport.is_closing()

    def close(self) -> None:
        if self.is_closing() or not self._client_still_sending() or not self._transport.can_write_eof():
            return self._transport.close()
        self.lingering = True
        self._transport.write_eof()  # after the response already buffered
        self._transport.resume_reading()  # flow control may have paused reads; the input must drain
        self._loop.call_later(self._seconds, self._transport.close)


def guarded_protocol(guard: GuardConfig) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a connection cap, a deadline for each request to arrive, and lingering closes."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._opened = self.loop.time()
            if len(self.connections) > guard.max_connections and not self._make_room():
                log.warning("%d open connections, each with a request in flight: closing a new one",
                            guard.max_connections)
                transport.close()
                return
            # the request cycles close through it: a lingering close while the request body is still arriving
            self.transport = LingeringTransport(transport, self.loop, lambda: self.conn.their_state is h11.SEND_BODY)
            self._arm()

        def _make_room(self) -> bool:
            """Over the cap, close the oldest connection that has not sent a whole request (idle keep-alive, or
            still sending), so that whoever holds that many idle sockets cannot lock the others out. False: every
            other one has a request in flight."""
            live = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and not c.transport.is_closing()]
            if len(live) <= guard.max_connections:  # the rest are closing already
                return True
            idle = [c for c in live if c is not self and c._awaiting_request()]
            if not idle:
                return False
            min(idle, key=lambda c: c._opened)._drop()
            return True

        def data_received(self, data: bytes) -> None:
            if getattr(self.transport, "lingering", False):
                return  # the rest of an upload we already answered
            super().data_received(data)
            if self._awaiting_request():
                self._arm()
            else:
                self._disarm()

        def on_response_complete(self) -> None:
            self._disarm()  # an idle keep-alive connection: uvicorn's own timeout closes it
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_request(self) -> bool:
            cycle = self.cycle
            return cycle is None or cycle.response_complete or cycle.more_body

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(guard.read_timeout_s, self._timed_out)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _timed_out(self) -> None:
            self._deadline = None
            if self._awaiting_request() and not self.transport.is_closing():
                self._drop()

        def _drop(self) -> None:
            """Close a connection whose request has not arrived whole."""
            self._disarm()
            if self.cycle is not None and not self.cycle.response_complete:  # the app waits for a body
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self.transport.close()

    return GuardedH11Protocol


def uvicorn_config(app, bind_host: str, guard: GuardConfig, **kwargs) -> uvicorn.Config:
    """The app behind GuardMiddleware, served by the guarded protocol."""
    import uvicorn

    guarded = GuardMiddleware(app, allowed_hosts(bind_host, guard), guard)
    return uvicorn.Config(guarded, http=guarded_protocol(guard), lifespan="on", **kwargs)


def raise_open_file_limit(wanted: int = 65536) -> None:
    """Lift the soft limit on open files toward the hard one (the default 256 or 1024 is soon reached by clients)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            log.warning("could not raise the open-file limit from %d", soft)
