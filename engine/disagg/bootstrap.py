"""The control plane's sockets: prefill's bootstrap server and decode's client links.

* :class:`BootstrapServer` (prefill) listens on ``--disaggregation-bootstrap-port``.
  Each decode worker opens one connection and sends ``Hello``; the server's
  ``on_hello`` callback answers ``Welcome`` or ``Refuse``.  After a welcome,
  every further frame goes to ``on_message(conn, msg)``, and the connection's
  end (EOF, reset, missed heartbeats, garbage) to ``on_closed(conn, reason)``,
  exactly once.
* :class:`BootstrapLink` (decode) is one connection to one prefill worker.  It
  connects, says ``Hello``, checks the ``Welcome`` with ``check_welcome`` (a
  layout mismatch is refused there with a clear reason) and then becomes
  ``ready``; ``on_ready`` / ``on_message`` / ``on_closed`` report to the owner.
  Connecting happens on the link's own thread, so a scheduler never blocks.

Both ends send ``Ping`` every ``heartbeat_interval`` seconds (``tick()``, called
by the owner's housekeeping thread) and close a connection that has been silent
for ``heartbeat_timeout`` seconds.  Sends are serialized by a per-connection
lock; every callback runs on the connection's reader thread.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Callable, Optional

from kvship.engine.disagg.wire import (
    FRAME_HEADER_BYTES,
    Hello,
    Message,
    Ping,
    Refuse,
    Welcome,
    WireError,
    decode_body,
    encode_frame,
    frame_length,
)

logger = logging.getLogger(__name__)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k
    return bytes(buf)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class FramedConnection:
    """A socket carrying length-prefixed control frames, with liveness tracking."""

    def __init__(self, sock: socket.socket, name: str):
        self.sock = sock
        self.name = name
        self._send_lock = threading.Lock()
        self._closed = threading.Event()
        self.close_reason: Optional[str] = None
        self.peer_id: Optional[str] = None  # set by the owner after the handshake
        self.last_recv = time.monotonic()
        self.last_send = time.monotonic()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def send(self, msg: Message) -> bool:
        """Send one frame; False (and the connection closed) if it cannot be sent."""
        data = encode_frame(msg)
        with self._send_lock:
            if self.closed:
                return False
            try:
                self.sock.sendall(data)
            except OSError as e:
                self._shutdown(f"send failed: {e}")
                return False
            self.last_send = time.monotonic()
        return True

    def recv(self) -> Message:
        """Next frame (blocking); raises ConnectionError / WireError."""
        n = frame_length(_recv_exact(self.sock, FRAME_HEADER_BYTES))
        msg = decode_body(_recv_exact(self.sock, n))
        self.last_recv = time.monotonic()
        return msg

    def tick(self, interval: float, timeout: float) -> None:
        """Heartbeat: ping when idle, close when the peer has been silent too long."""
        now = time.monotonic()
        if self.closed:
            return
        if now - self.last_recv > timeout:
            self._shutdown(f"no heartbeat from peer for {now - self.last_recv:.1f} s")
        elif now - self.last_send >= interval:
            self.send(Ping())

    def _shutdown(self, reason: str) -> None:
        if self.close_reason is None:
            self.close_reason = reason
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self, reason: str = "closed locally") -> None:
        self._shutdown(reason)

    def finish(self) -> None:
        """Called by the reader thread when it exits."""
        self._closed.set()
        try:
            self.sock.close()
        except OSError:
            pass


class BootstrapServer:
    """Prefill's bootstrap endpoint: accepts decode connections on ``(host, port)``."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        on_hello: Callable[[FramedConnection, Hello], Message],
        on_message: Callable[[FramedConnection, Message], None],
        on_closed: Callable[[FramedConnection, str], None],
        handshake_timeout: float = 30.0,
    ):
        self._on_hello = on_hello
        self._on_message = on_message
        self._on_closed = on_closed
        self._handshake_timeout = handshake_timeout
        self._lock = threading.Lock()
        self._conns: set[FramedConnection] = set()
        self._threads: list[threading.Thread] = []
        self._stopped = threading.Event()
        bind_host = host if host not in ("localhost",) else "127.0.0.1"
        try:
            self._sock = socket.create_server((bind_host, port), reuse_port=False)
        except OSError as e:
            raise OSError(f"cannot bind the KV bootstrap server on {bind_host}:{port}: {e}") from e
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._accept_loop, name=f"kv-bootstrap-{self.port}", daemon=True)
        self._thread.start()

    def connections(self) -> list[FramedConnection]:
        with self._lock:
            return list(self._conns)

    def _accept_loop(self) -> None:
        while not self._stopped.is_set():
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return
            _tune(sock)
            conn = FramedConnection(sock, f"{addr[0]}:{addr[1]}")
            t = threading.Thread(target=self._serve, args=(conn,), name=f"kv-bootstrap-conn-{addr[1]}", daemon=True)
            with self._lock:
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _serve(self, conn: FramedConnection) -> None:
        welcomed = False
        reason = "connection closed by peer"
        try:
            conn.sock.settimeout(self._handshake_timeout)
            first = conn.recv()
            conn.sock.settimeout(None)
            if not isinstance(first, Hello):
                raise WireError(f"expected hello, got {first.TYPE}")
            answer = self._on_hello(conn, first)
            if not isinstance(answer, Welcome):
                conn.send(answer)
                reason = f"refused: {answer.reason}" if isinstance(answer, Refuse) else "refused"
                return
            with self._lock:
                if self._stopped.is_set():
                    return
                self._conns.add(conn)
            welcomed = True
            if not conn.send(answer):
                return
            while True:
                self._on_message(conn, conn.recv())
        except WireError as e:
            reason = f"protocol error: {e}"
            logger.warning("bootstrap connection %s: %s", conn.name, reason)
            conn.send(Refuse(reason=str(e)))
        except (ConnectionError, OSError) as e:
            reason = conn.close_reason or f"connection lost: {e}"
        finally:
            conn.close(reason)
            conn.finish()
            if welcomed:
                with self._lock:
                    self._conns.discard(conn)
                self._on_closed(conn, conn.close_reason or reason)

    def tick(self, interval: float, timeout: float) -> None:
        for conn in self.connections():
            conn.tick(interval, timeout)

    def close(self) -> None:
        self._stopped.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept() (close alone does not)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        for conn in self.connections():
            conn.close("bootstrap server shutting down")
        with self._lock:
            threads = list(self._threads)
        for t in [self._thread] + threads:
            t.join(timeout=2)


class BootstrapLink:
    """Decode's connection to one prefill worker's bootstrap server."""

    def __init__(
        self,
        host: str,
        port: int,
        hello: Hello,
        *,
        connect_timeout: float,
        handshake_timeout: float,
        check_welcome: Callable[[Welcome], Optional[str]],
        on_ready: Callable[["BootstrapLink"], None],
        on_message: Callable[["BootstrapLink", Message], None],
        on_closed: Callable[["BootstrapLink", str], None],
    ):
        self.host, self.port = host, port
        self.address = f"{host}:{port}"
        self._hello = hello
        self._connect_timeout = connect_timeout
        self._handshake_timeout = handshake_timeout
        self._check_welcome = check_welcome
        self._on_ready = on_ready
        self._on_message = on_message
        self._on_closed = on_closed
        self.conn: Optional[FramedConnection] = None
        self.welcome: Optional[Welcome] = None
        self.ready = False
        self.dead = False
        self.dead_reason: Optional[str] = None
        self._abandoned = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-link-{self.address}", daemon=True)
        self._thread.start()

    def send(self, msg: Message) -> bool:
        conn = self.conn
        return conn is not None and self.ready and conn.send(msg)

    def tick(self, interval: float, timeout: float) -> None:
        if self.ready and self.conn is not None:
            self.conn.tick(interval, timeout)

    def _run(self) -> None:
        reason = "connection closed by prefill"
        try:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=self._connect_timeout)
            except OSError as e:
                reason = f"cannot reach prefill bootstrap server {self.address}: {e}"
                return
            _tune(sock)
            conn = FramedConnection(sock, self.address)
            self.conn = conn
            if self._abandoned.is_set():
                reason = "link closed locally"
                return
            sock.settimeout(self._handshake_timeout)
            if not conn.send(self._hello):
                reason = f"prefill {self.address}: {conn.close_reason}"
                return
            answer = conn.recv()
            sock.settimeout(None)
            if isinstance(answer, Refuse):
                reason = f"prefill {self.address} refused the handshake: {answer.reason}"
                return
            if not isinstance(answer, Welcome):
                reason = f"prefill {self.address} answered {answer.TYPE} instead of welcome"
                return
            problem = self._check_welcome(answer)
            if problem:
                reason = problem
                return
            self.welcome = answer
            self.ready = True
            self._on_ready(self)
            while True:
                self._on_message(self, conn.recv())
        except TimeoutError:
            reason = f"prefill {self.address}: handshake timed out after {self._handshake_timeout:.0f} s"
        except WireError as e:
            reason = f"prefill {self.address}: protocol error: {e}"
        except (ConnectionError, OSError) as e:
            c = self.conn
            reason = f"prefill {self.address} disconnected: {(c.close_reason if c else None) or e}"
        finally:
            self.ready = False
            self.dead = True
            self.dead_reason = reason
            if self.conn is not None:
                self.conn.close(reason)
                self.conn.finish()
            self._on_closed(self, reason)

    def close(self, reason: str = "link closed locally") -> None:
        """Close the connection and wait (briefly) for the link's thread to finish."""
        self._abandoned.set()
        if self.conn is not None:
            self.conn.close(reason)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=self._connect_timeout + 2)
