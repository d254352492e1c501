"""The HTTP connections of ``ctrl serve``: uvicorn's HTTP/1.1 protocol with the bounds an endpoint needs.

* At most ``max_connections`` are open at once; one more is answered 503 and closed before its
  request is read.
* A request's headers must be complete within ``header_timeout_s`` of the connection opening (or of
  the previous reply on it): a client that sends headers slowly is answered 408 and closed, one
  that sends nothing (an idle connection of a client's pool) is closed without a word.
* The body's own deadline is the app's (:func:`serve.app.read_body`); a body the app answered
  without reading (a 401, a 403) is read and dropped, at most for ``body_timeout_s``, so that the
  client, which sends its whole body before it reads, gets the reply.
* Replies must drain: a connection whose replies have waited in its send buffer for
  ``write_timeout_s`` (a client that sends requests and never reads the answers) is closed at once.
* At most ``max_pipelined`` requests are answered that a client sent before the previous reply was
  complete (pipelined); after them the server ends its side of the connection and drops what else
  comes, so the replies it wrote still reach a client that reads them.
* A client that half-closes (shuts down its sending side after its request) is still answered,
  whatever the request (HTTP/1.0, ``Connection: close``, pipelined requests, a stream under way).
  Its end of file looks the same as a client that closed and left, so where no reply has started the
  server writes an interim ``100 Continue`` (which HTTP/1.1 clients skip) and watches the socket: a
  client that has left resets it, and its request is cancelled as a disconnect. A stream's next
  chunk is that probe once it has started; an HTTP/1.0 client gets no 1xx and is simply answered.
* Bodies in flight take places of their own (:class:`UploadPlaces`), not places in the model's
  queue: a body's first byte takes one, and one client address (where the server can tell clients
  apart) may hold at most a share of them.

Every connection dropped this way is counted (``ctrl_connections_dropped_total{reason}``) and the
server's log says so, one line per reason at most every ``LOG_EVERY_S`` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

#: the reasons a connection is dropped (the label of ctrl_connections_dropped_total)
DROP_REASONS = ("too_many_connections", "header_timeout", "body_timeout", "client_left", "write_timeout",
                "too_many_pipelined", "invalid_request")
#: the least time between two log lines of one drop reason
LOG_EVERY_S = 10.0
#: how often the socket of a half-closed client is looked at
HALF_CLOSE_POLL_S = 0.02
#: how long a refused connection is read (and dropped) so that its client can read the refusal
LINGER_S = 1.0
#: Linux's tcp_info.tcpi_state of a connection the peer has reset
_TCP_CLOSE = 7
#: how many times within ``write_timeout_s`` a connection's send buffer is looked at
WRITE_CHECKS = 8

logger = logging.getLogger("uvicorn.error")


def _raw_response(status: int, reason: str, message: str, extra: str = "") -> bytes:
    body = ('{"error": {"message": "%s", "type": "invalid_request_error", "param": null, "code": null}}'
            % message).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode() + body


@dataclass
class ConnectionLimits:
    """The bounds on connections and what was dropped (shared by every connection of one server)."""

    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    write_timeout_s: float = 10.0
    max_pipelined: int = 8
    #: called with the reason of each dropped connection (the metric)
    on_drop: Callable[[str], None] = lambda reason: None
    _logged: dict[str, tuple[float, int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def dropped(self, reason: str, client: Any) -> None:
        """Count a dropped connection; log it, or add it to the next line of its reason."""
        self.on_drop(reason)
        now = time.monotonic()
        with self._lock:
            last, unlogged = self._logged.get(reason, (-LOG_EVERY_S, 0))
            if now - last < LOG_EVERY_S:
                self._logged[reason] = (last, unlogged + 1)
                return
            self._logged[reason] = (now, 0)
        where = f"{client[0]}:{client[1]}" if client else "a client"
        more = f" (and {unlogged} more since the last line)" if unlogged else ""
        logger.warning("dropped the connection of %s: %s%s", where, _DROP_TEXT[reason](self), more)


_DROP_TEXT: dict[str, Callable[[ConnectionLimits], str]] = {
    "too_many_connections": lambda lim: f"{lim.max_connections} connections are open (--max-connections)",
    "header_timeout": lambda lim: f"its request headers were not complete within {lim.header_timeout_s:g} s "
                                  "(--header-timeout-s)",
    "body_timeout": lambda lim: f"its request body did not arrive within {lim.body_timeout_s:g} s "
                                "(--body-timeout-s)",
    "client_left": lambda lim: "the client closed it before its request's body was complete",
    "write_timeout": lambda lim: f"its replies were not read within {lim.write_timeout_s:g} s (--write-timeout-s)",
    "too_many_pipelined": lambda lim: f"it sent more than {lim.max_pipelined} requests ahead of their replies "
                                      "(--max-pipelined)",
    "invalid_request": lambda lim: "what it sent is not an HTTP/1.1 request (answered 400)",
}
#: uvicorn's own line for a request h11 cannot parse: replaced by the counted, rate-limited one above
_UVICORN_INVALID = "Invalid HTTP request received."


def _not_uvicorns_invalid_request(record: logging.LogRecord) -> bool:
    return record.msg != _UVICORN_INVALID


@dataclass
class UploadPlaces:
    """The request bodies being received at once: at most ``total``, and at most ``per_client`` for
    one client address where addresses tell clients apart (not loopback, where every local process
    has the same one, nor behind a proxy, ``by_address=False``)."""

    total: int
    per_client: int
    by_address: bool = True
    _held: dict[str, int] = field(default_factory=dict)
    _count: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, client: Any) -> Callable[[], None] | None:
        """A place for one body (call the result to give it back), or None when there is none."""
        address = client[0] if client and self.by_address and not _is_loopback(client[0]) else None
        with self._lock:
            if self._count >= self.total or (address is not None
                                             and self._held.get(address, 0) >= self.per_client):
                return None
            self._count += 1
            if address is not None:
                self._held[address] = self._held.get(address, 0) + 1
        given = False

        def give_back() -> None:
            nonlocal given
            with self._lock:
                if given:
                    return
                given = True
                self._count -= 1
                if address is not None:
                    left = self._held[address] - 1
                    if left:
                        self._held[address] = left
                    else:
                        del self._held[address]

        return give_back

    @property
    def held(self) -> int:
        return self._count


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1, a dual-stack socket's loopback client
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


_REFUSED = _raw_response(503, "Service Unavailable", "the server has too many open connections; retry later",
                         "retry-after: 1\r\n")
_TIMED_OUT = _raw_response(408, "Request Timeout", "the request was not received in time")


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the bounds of the module's docstring (:func:`protocol_class` gives
    it the server's :class:`ConnectionLimits`)."""

    limits: ClassVar[ConnectionLimits]

    _timer: asyncio.TimerHandle | None = None
    _reason = ""
    _timer_cycle: Any = None
    _lingering = False
    _peer_eof = False
    _request_begun = False  # bytes of a request have come since the connection opened or last replied
    _pipelined = 0  # requests answered in a row that came before the previous reply was complete
    _write_timer: asyncio.TimerHandle | None = None
    _write_since = 0.0  # when the send buffer was last seen empty or draining
    _write_left = 0  # its size then

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.limits.dropped("too_many_connections", self.client)
            self._linger(_REFUSED)
            return
        self._arm(self.limits.header_timeout_s, "header_timeout")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self.limits.dropped("invalid_request", self.client)
        super().send_400_response(msg)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_writes()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._write_since = self.loop.time()  # the client reads: the deadline starts again

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        self._request_begun = self._request_begun or bool(data)
        super().data_received(data)
        if self._timer is None:
            return
        if self._reason == "header_timeout" and self.conn.their_state is not h11.IDLE:
            self._disarm()  # the headers are in: the body's deadline is the app's
        elif self._reason == "body_timeout" and (self.cycle is not self._timer_cycle
                                                 or self.conn.their_state is h11.IDLE):
            # the dropped body is over: the next request's headers are timed, if they are not in yet
            if self.conn.their_state is h11.IDLE:
                self._arm(self.limits.header_timeout_s, "header_timeout")
            else:
                self._disarm()

    def eof_received(self) -> bool | None:
        cycle = self.cycle
        if (self._lingering or cycle is None or cycle.response_complete
                or self.conn.their_state not in (h11.DONE, h11.MUST_CLOSE) or not _can_watch(self.transport)):
            return None  # mid-request or between requests: the connection is over
        # the whole request is in: a half-close (answer it) or a client that left (it resets the probe)
        self._peer_eof = True
        if not cycle.response_started and self.conn.their_http_version == b"1.1":
            cycle.waiting_for_100_continue = False
            with contextlib.suppress(h11.LocalProtocolError):
                self.transport.write(self.conn.send(h11.InformationalResponse(status_code=100, headers=[],
                                                                              reason=b"Continue")))
        self.loop.call_later(HALF_CLOSE_POLL_S, self._watch_half_closed)
        return True

    def on_response_complete(self) -> None:
        answered = self.cycle
        pipelined = self.conn.their_state is h11.DONE and bool(self.conn.trailing_data[0])
        self._pipelined = self._pipelined + 1 if pipelined else 0
        if self._pipelined > self.limits.max_pipelined and not self.transport.is_closing():
            self.server_state.total_requests += 1
            self.limits.dropped("too_many_pipelined", self.client)
            self._linger(b"")  # the replies written reach the client; what else it sent is dropped
            self._watch_writes()
            return
        super().on_response_complete()
        if self.transport.get_write_buffer_size():
            self._watch_writes()
        if self.transport.is_closing():
            return
        if self._peer_eof:  # nothing more can come from a client that half-closed
            if self.cycle is answered:  # no pipelined request of its is being answered now
                self.transport.close()
        elif self.conn.their_state is h11.IDLE:
            self._request_begun = bool(self.conn.trailing_data[0])  # a pipelined request's first bytes
            self._arm(self.limits.header_timeout_s, "header_timeout")
        elif self.conn.their_state is h11.SEND_BODY:  # answered before its body was read: read and drop it
            self._arm(self.limits.body_timeout_s, "body_timeout")

    def _watch_half_closed(self) -> None:
        if self.transport.is_closing():
            return
        if _tcp_state(self.transport) == _TCP_CLOSE:  # the client reset the probe: it has left
            self.transport.abort()  # connection_lost marks the request disconnected
            return
        self.loop.call_later(HALF_CLOSE_POLL_S, self._watch_half_closed)

    def _watch_writes(self) -> None:
        """Close the connection at once when what it was sent waits unread for ``write_timeout_s``."""
        if self._write_timer is None:
            self._write_since, self._write_left = self.loop.time(), self.transport.get_write_buffer_size()
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s / WRITE_CHECKS, self._check_writes)

    def _check_writes(self) -> None:
        self._write_timer = None
        left = self.transport.get_write_buffer_size()
        if not left:
            return
        if left < self._write_left:  # it drains, slowly
            self._write_since = self.loop.time()
        self._write_left = left
        if self.loop.time() - self._write_since >= self.limits.write_timeout_s:
            self.limits.dropped("write_timeout", self.client)
            self.transport.abort()
            return
        self._write_timer = self.loop.call_later(self.limits.write_timeout_s / WRITE_CHECKS, self._check_writes)

    def _arm(self, seconds: float, reason: str) -> None:
        self._disarm()
        self._reason, self._timer_cycle = reason, self.cycle
        self._timer = self.loop.call_later(seconds, self._expire, reason)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, reason: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if reason == "header_timeout" and not self._request_begun:
            self.transport.close()  # an idle connection (a client's pool): closed, not a fault
            return
        self.limits.dropped(reason, self.client)
        if reason == "header_timeout":
            self.transport.write(_TIMED_OUT)
        self.transport.close()

    def _linger(self, reply: bytes) -> None:
        """Write ``reply``, end the sending side, and drop what the client still sends for a moment
        before closing: closing with unread bytes would reset the connection before it reads the reply."""
        self._lingering = True
        if reply:
            self.transport.write(reply)
        with contextlib.suppress(OSError, NotImplementedError, RuntimeError):
            self.transport.write_eof()
        self.flow.resume_reading()  # what else comes is read and dropped
        self.loop.call_later(LINGER_S, self.transport.close)


def protocol_class(limits: ConnectionLimits) -> type[BoundedH11Protocol]:
    """uvicorn's h11 protocol class with ``limits`` (uvicorn.Config's ``http``)."""
    if _not_uvicorns_invalid_request not in logger.filters:
        logger.addFilter(_not_uvicorns_invalid_request)
    return type("BoundedH11Protocol", (BoundedH11Protocol,), {"limits": limits})


def _can_watch(transport: asyncio.BaseTransport) -> bool:
    return hasattr(socket, "TCP_INFO") and _tcp_state(transport) is not None


def _tcp_state(transport: asyncio.BaseTransport) -> int | None:
    """The socket's TCP state (Linux's tcp_info), None where it cannot be read."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]
    except OSError:
        return None
