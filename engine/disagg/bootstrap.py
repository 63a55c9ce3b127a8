"""The control plane's sockets: prefill's bootstrap server and decode's client links.

Every connection authenticates first (``Hello0`` / ``Challenge`` / ``Auth``,
wire.py; docs/pd.md, "KV plane authentication"): until then frames are at most
``PREAUTH_MAX_FRAME`` bytes, the whole handshake (through ``Hello``) must end
within ``handshake_timeout`` of the connect, and a peer that fails gets a bare
``Refuse("authentication failed")`` and the connection closes.  Frame bodies
are read in chunks after their length was checked against the connection's
current cap (``FramedConnection.max_frame``), so a length that lies costs nothing.

* :class:`BootstrapServer` (prefill) listens on ``--disaggregation-bootstrap-port``.
  At most ``max_connections`` connections at once, of which at most
  ``max_handshakes`` still authenticating; a connection over either limit is
  closed at once.  Each decode worker opens one connection, authenticates and
  sends ``Hello``; the server's ``on_hello`` callback answers ``Welcome`` or ``Refuse``.  After a welcome,
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

from kvship.engine.disagg import auth as A
from kvship.engine.disagg.wire import (
    _READ_CHUNK,
    CONTROL_MAX_FRAME,
    FRAME_HEADER_BYTES,
    HANDSHAKE_MAX_FRAME,
    PREAUTH_MAX_FRAME,
    Auth,
    Challenge,
    Hello,
    Hello0,
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

AUTH_FAILED = "authentication failed"


class AuthError(WireError):
    """The peer did not prove it holds the KV transfer secret (or its auth mode differs); ``public`` is all it
    is told."""

    def __init__(self, reason: str, public: str = AUTH_FAILED):
        super().__init__(reason)
        self.public = public


class ThrottledLog:
    """Warnings about unauthenticated peers: at most one per ``every`` seconds, the others counted into the next
    (a flood of bad connections must not flood the log)."""

    def __init__(self, every: float = 10.0):
        self.every = every
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._suppressed = 0

    def warning(self, msg: str, *args) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.every:
                self._suppressed += 1
                return
            self._last, n, self._suppressed = now, self._suppressed, 0
        if n:
            logger.warning(msg + " (and %d more such connections since the last report)", *args, n)
        else:
            logger.warning(msg, *args)


def recv_exact(sock: socket.socket, n: int, deadline: Optional[float] = None) -> bytes:
    """``n`` bytes (``n`` already checked against a cap by the caller), read in chunks of at most
    ``_READ_CHUNK``: the buffer grows only as bytes arrive.  ``deadline`` (monotonic): TimeoutError after it."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("handshake timed out")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), _READ_CHUNK))
        if not chunk:
            raise ConnectionError("connection closed by peer")
        buf += chunk
    return bytes(buf)


def _unhex(text: str, size: int, what: str) -> bytes:
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != size:
        raise AuthError(f"{what} is not {size} bytes of hex")
    return raw


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
        self.max_frame = PREAUTH_MAX_FRAME  # raised by the owner as the handshake proceeds
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

    def recv(self, deadline: Optional[float] = None) -> Message:
        """Next frame (blocking; until ``deadline``, monotonic, if given); raises ConnectionError / WireError /
        TimeoutError.  A frame over ``max_frame`` is a WireError before any of its body is read."""
        n = frame_length(recv_exact(self.sock, FRAME_HEADER_BYTES, deadline), self.max_frame)
        msg = decode_body(recv_exact(self.sock, n, deadline))
        if deadline is not None:
            self.sock.settimeout(None)
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
    """Prefill's bootstrap endpoint: accepts decode connections on ``(host, port)``.

    ``secret``: the KV transfer secret (None: authentication off, ``--kv-transfer-insecure``).
    ``on_hello`` may raise ``conn.max_frame`` for the frames that follow its Welcome (``control_frame_cap``).
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        on_hello: Callable[[FramedConnection, Hello], Message],
        on_message: Callable[[FramedConnection, Message], None],
        on_closed: Callable[[FramedConnection, str], None],
        secret: Optional[bytes],
        handshake_timeout: float = 5.0,
        max_connections: int = 256,
        max_handshakes: int = 32,
    ):
        self._on_hello = on_hello
        self._on_message = on_message
        self._on_closed = on_closed
        self._secret = secret
        self._handshake_timeout = handshake_timeout
        self._max_connections = max_connections
        self._max_handshakes = max_handshakes
        self._lock = threading.Lock()
        self._conns: set[FramedConnection] = set()
        self._open = 0  # connections being served (handshaking or welcomed)
        self._handshaking = 0
        self.rejected = 0  # connections closed at once for the limits
        self._unauthenticated = ThrottledLog()
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
                if self._stopped.is_set():
                    return
                time.sleep(0.01)  # e.g. out of file descriptors: keep serving the others
                continue
            with self._lock:
                full = self._open >= self._max_connections or self._handshaking >= self._max_handshakes
                if not full:
                    self._open += 1
                    self._handshaking += 1
                else:
                    self.rejected += 1
            if full:
                sock.close()  # over the limits: closed at once, nothing said
                continue
            try:
                _tune(sock)
                conn = FramedConnection(sock, f"{addr[0]}:{addr[1]}")
                t = threading.Thread(target=self._serve, args=(conn,), name=f"kv-bootstrap-conn-{addr[1]}", daemon=True)
                with self._lock:
                    self._threads = [x for x in self._threads if x.is_alive()] + [t]
                t.start()
            except Exception:  # noqa: BLE001 - e.g. no thread could be started: drop this connection alone
                logger.exception("bootstrap server could not serve a connection from %s", addr)
                sock.close()
                with self._lock:
                    self._open -= 1
                    self._handshaking -= 1

    def _authenticate(self, conn: FramedConnection, deadline: float) -> None:
        """The server's half of Hello0 / Challenge / Auth; AuthError if the peer fails it."""
        first = conn.recv(deadline)
        if not isinstance(first, Hello0):
            raise AuthError(f"expected hello0, got {first.TYPE}")
        mine = "none" if self._secret is None else "hmac-sha256"
        if first.auth != mine:
            why = (
                f"KV-plane authentication differs: decode says {first.auth[:16]!r}, prefill {mine!r} "
                "(--kv-transfer-insecure must be set on both workers or on neither)"
            )
            raise AuthError(why, public=why)
        if self._secret is None:
            conn.send(Challenge(auth=mine, nonce=""))
            return
        nonce_d = _unhex(first.nonce, A.NONCE_BYTES, "nonce")
        nonce_p = A.new_nonce()
        mac_p, mac_d = A.control_macs(self._secret, nonce_d, nonce_p)
        if not conn.send(Challenge(auth=mine, nonce=nonce_p.hex(), mac=mac_p.hex())):
            raise ConnectionError(conn.close_reason or "send failed")
        answer = conn.recv(deadline)
        if not isinstance(answer, Auth) or not A.same(_unhex(answer.mac, A.MAC_BYTES, "mac"), mac_d):
            raise AuthError(AUTH_FAILED)

    def _serve(self, conn: FramedConnection) -> None:
        welcomed = False
        handshaking = True
        reason = "connection closed by peer"
        try:
            deadline = time.monotonic() + self._handshake_timeout
            authed = False
            try:
                self._authenticate(conn, deadline)
                authed = True
                conn.max_frame = HANDSHAKE_MAX_FRAME
                first = conn.recv(deadline)
            except AuthError as e:
                # the only thing an unauthenticated peer hears: no layout, no addresses (docs/pd.md)
                reason = f"authentication failed: {e}"
                self._unauthenticated.warning("bootstrap connection %s: %s", conn.name, reason)
                conn.send(Refuse(reason=e.public))
                return
            except (WireError, TimeoutError) as e:
                if authed:
                    raise
                reason = f"protocol error before authentication: {e}"
                self._unauthenticated.warning("bootstrap connection %s: %s", conn.name, reason)
                conn.send(Refuse(reason=AUTH_FAILED))
                return
            if not isinstance(first, Hello):
                raise WireError(f"expected hello, got {first.TYPE}")
            answer = self._on_hello(conn, first)
            with self._lock:
                self._handshaking -= 1
                handshaking = False
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
        except TimeoutError:
            reason = f"handshake not finished within {self._handshake_timeout:g} s"
            logger.warning("bootstrap connection %s: %s", conn.name, reason)
        except (ConnectionError, OSError) as e:
            reason = conn.close_reason or f"connection lost: {e}"
        except Exception as e:  # noqa: BLE001 - malformed input ends this connection, never the server
            reason = f"internal error: {type(e).__name__}: {e}"
            logger.exception("bootstrap connection %s", conn.name)
        finally:
            conn.close(reason)
            conn.finish()
            with self._lock:
                self._open -= 1
                if handshaking:
                    self._handshaking -= 1
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
        secret: Optional[bytes],
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
        self._secret = secret
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
            deadline = time.monotonic() + self._handshake_timeout
            problem = self._authenticate(conn, deadline)
            if problem:
                reason = f"prefill {self.address}: {problem}"
                return
            conn.max_frame = HANDSHAKE_MAX_FRAME
            if not conn.send(self._hello):
                reason = f"prefill {self.address}: {conn.close_reason}"
                return
            answer = conn.recv(deadline)
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
            conn.max_frame = CONTROL_MAX_FRAME
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

    def _authenticate(self, conn: FramedConnection, deadline: float) -> Optional[str]:
        """Decode's half of Hello0 / Challenge / Auth: None once prefill proved it holds the secret (and this
        side's proof is sent), else why not."""
        mode = "none" if self._secret is None else "hmac-sha256"
        nonce_d = A.new_nonce()
        if not conn.send(Hello0(auth=mode, nonce=nonce_d.hex())):
            return str(conn.close_reason)
        answer = conn.recv(deadline)
        if isinstance(answer, Refuse):
            return f"refused the handshake: {answer.reason}"
        if not isinstance(answer, Challenge):
            return f"answered {answer.TYPE} instead of challenge"
        if answer.auth != mode:
            return (
                f"KV-plane authentication differs: prefill says {answer.auth[:16]!r}, decode {mode!r} "
                "(--kv-transfer-insecure must be set on both workers or on neither)"
            )
        if self._secret is None:
            return None
        try:
            nonce_p = _unhex(answer.nonce, A.NONCE_BYTES, "nonce")
            mac_p = _unhex(answer.mac, A.MAC_BYTES, "mac")
        except AuthError:
            mac_p, nonce_p = b"", b""
        want_p, mac_d = A.control_macs(self._secret, nonce_d, nonce_p)
        if not nonce_p or not A.same(mac_p, want_p):
            return f"{AUTH_FAILED}: prefill does not hold this worker's KV transfer secret"
        if not conn.send(Auth(mac=mac_d.hex())):
            return str(conn.close_reason)
        return None

    def close(self, reason: str = "link closed locally") -> None:
        """Close the connection and wait (briefly) for the link's thread to finish."""
        self._abandoned.set()
        if self.conn is not None:
            self.conn.close(reason)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=self._connect_timeout + 2)
