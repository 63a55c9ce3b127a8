"""KV-plane authentication and bounded parsers (issue 30; docs/pd.md "KV plane authentication").

Real managers on loopback in this process (tcp everywhere; mooncake and nixl where their CPU builds load),
talked to by raw sockets that play a peer without the secret, a peer with the secret but without a room's
token, and a peer that lies about lengths.  The fuzz test lives in test_kv_fuzz.py.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import struct
import time
import types

import numpy as np
import pytest
import torch
from pd_fixtures import KV_SECRET, room_token

from kvship.engine.config import ServerArgs
from kvship.engine.disagg import AuxInfo, KVPoll, KVTransferConfig, create_kv_manager
from kvship.engine.disagg import auth as A
from kvship.engine.disagg.base import BackendUnavailableError, get_transfer_backend
from kvship.engine.disagg.wire import AUX_RECORD_BYTES, AuxRecord
from kvship.engine.http_errors import APIError
from kvship.engine.io_struct import GenerateRequest, SamplingParams
from kvship.engine.mem.pools import KVPool
from kvship.engine.serving import check_bootstrap_token
from kvship.router.wire import PDBootstrap

BACKENDS = ["tcp", "mooncake", "nixl"]
PAGE = 4


def _backend(name: str) -> str:
    try:
        get_transfer_backend(name)
    except BackendUnavailableError as e:
        pytest.skip(f"{name} not installed: {e}")
    return name


def _pool(fill: bool) -> KVPool:
    pool = KVPool(64, PAGE, torch.float32, 2, 8, 2, "cpu")
    g = torch.Generator().manual_seed(7)
    for b in pool.buffers():
        b.copy_(torch.randn(b.shape, generator=g) if fill else torch.zeros(b.shape))
    return pool


def _cfg(backend: str, **kw) -> KVTransferConfig:
    return KVTransferConfig(
        backend=backend, bootstrap_port=0, heartbeat_interval=0.5, heartbeat_timeout=5.0, **{"secret": KV_SECRET, **kw}
    )


def _wait(obj, timeout: float = 30.0) -> KVPoll:
    deadline = time.monotonic() + timeout
    while not obj.poll().is_terminal and time.monotonic() < deadline:
        time.sleep(0.005)
    return obj.poll()


# --- raw protocol helpers (a peer written by hand) -----------------------------------------------------


def _frame(d: dict) -> bytes:
    body = json.dumps({"v": 1, **d}).encode()
    return struct.pack(">I", len(body)) + body


def _read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return out
        if not chunk:
            return out
        out += chunk


def _frames(raw: bytes) -> list[dict]:
    out = []
    while len(raw) >= 4:
        (n,) = struct.unpack(">I", raw[:4])
        out.append(json.loads(raw[4 : 4 + n]))
        raw = raw[4 + n :]
    return out


def _bootstrap_auth(sock: socket.socket, secret: bytes) -> None:
    """Authenticate on a bootstrap port as decode does (asserts prefill's proof)."""
    nonce_d = A.new_nonce()
    sock.sendall(_frame({"type": "hello0", "auth": "hmac-sha256", "nonce": nonce_d.hex()}))
    (n,) = struct.unpack(">I", sock.recv(4, socket.MSG_WAITALL))
    ch = json.loads(sock.recv(n, socket.MSG_WAITALL))
    mac_p, mac_d = A.control_macs(secret, nonce_d, bytes.fromhex(ch["nonce"]))
    assert ch["type"] == "challenge" and bytes.fromhex(ch["mac"]) == mac_p
    sock.sendall(_frame({"type": "auth", "mac": mac_d.hex()}))


def _data_auth(sock: socket.socket, secret: bytes) -> None:
    """Authenticate on a tcp data port as prefill does."""
    hello = sock.recv(5 + A.NONCE_BYTES, socket.MSG_WAITALL)
    nonce_p = A.new_nonce()
    mac_p, mac_d = A.data_macs(secret, hello[5:], nonce_p)
    sock.sendall(b"\x01" + nonce_p + mac_p)
    assert sock.recv(A.MAC_BYTES, socket.MSG_WAITALL) == mac_d


def _tcp_frame(room: int, tag: bytes, table: list[tuple[int, int, int]], done: bool) -> bytes:
    head = struct.pack("<4sB3xQQ16s", b"KVT2", int(done), room, len(table), tag)
    descs = b"".join(struct.pack("<qqq", *d) for d in table)
    return head + descs + bytes(sum(d[2] for d in table))


# --- the secret and the token ----------------------------------------------------------------------------


def test_pd_worker_without_a_secret_gets_an_error_naming_both_ways(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSHIP_KV_TRANSFER_SECRET", raising=False)
    args = ServerArgs(mode="prefill")
    with pytest.raises(ValueError, match="--kv-transfer-secret-file.*KVSHIP_KV_TRANSFER_SECRET"):
        KVTransferConfig.from_server_args(args)
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(ValueError, match="at least 16"):
        KVTransferConfig.from_server_args(ServerArgs(mode="decode", kv_transfer_secret_file=str(short)))
    good = tmp_path / "good"
    good.write_text("  a-secret-of-enough-bytes \n")
    cfg = KVTransferConfig.from_server_args(ServerArgs(mode="decode", kv_transfer_secret_file=str(good)))
    assert cfg.secret == b"a-secret-of-enough-bytes" and "a-secret" not in repr(cfg)
    assert KVTransferConfig.from_server_args(ServerArgs(mode="decode", kv_transfer_insecure=True)).secret is None
    with pytest.raises(ValueError, match="KV transfer secret"):
        KVTransferConfig().validate()


def test_room_tokens_are_random_hidden_and_derived_per_choice():
    a = PDBootstrap.for_prefill("http://10.0.0.1:30000", 8998)
    b = PDBootstrap.for_prefill("http://10.0.0.1:30000", 8998)
    assert a.room != b.room and a.token != b.token and A.token_problem(a.token) is None
    assert a.token not in repr(a)
    assert json.loads(a.inject({"text": "x", "bootstrap_token": "mine-mine-mine-mine"}))["bootstrap_token"] == a.token
    req = GenerateRequest(rid="r", input_ids=[1], sampling_params=SamplingParams(), bootstrap_token=a.token)
    assert a.token not in repr(req)
    tokens = {A.choice_token(a.token, i) for i in range(4)}
    assert len(tokens) == 4 and A.choice_token(a.token, 0) == a.token
    assert all(A.token_problem(t) is None for t in tokens) and A.choice_token(a.token, 2) == A.choice_token(a.token, 2)


def test_pd_worker_answers_400_without_a_room_token():
    engine = types.SimpleNamespace(server_args=ServerArgs(mode="decode"))
    with pytest.raises(APIError) as e:
        check_bootstrap_token(engine, None)
    assert (
        e.value.status == 400
        and "bootstrap_token is required" in e.value.message
        and e.value.param == "bootstrap_token"
    )
    with pytest.raises(APIError):
        check_bootstrap_token(engine, "short")
    check_bootstrap_token(engine, room_token(5))
    check_bootstrap_token(types.SimpleNamespace(server_args=ServerArgs(mode="decode", kv_transfer_insecure=True)), None)
    check_bootstrap_token(types.SimpleNamespace(server_args=ServerArgs(mode="unified")), None)


# --- the bootstrap handshake ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_peer_without_the_secret_gets_nothing_but_a_refusal(backend):
    _backend(backend)
    with create_kv_manager("prefill", _pool(True), _cfg(backend)) as p:
        seen = b""
        # a wrong proof
        with socket.create_connection(("127.0.0.1", p.bootstrap_port), timeout=5) as s:
            s.sendall(_frame({"type": "hello0", "auth": "hmac-sha256", "nonce": A.new_nonce().hex()}))
            (n,) = struct.unpack(">I", s.recv(4, socket.MSG_WAITALL))
            seen += s.recv(n, socket.MSG_WAITALL)
            s.sendall(_frame({"type": "auth", "mac": "00" * 32}))
            rest = _read_all(s)
            seen += rest
            assert _frames(rest) == [{"v": 1, "type": "refuse", "reason": "authentication failed"}]
        # straight to Hello, as a pre-authentication decode would
        hello = {"type": "hello", "peer_id": "x", "backend": backend, "layout": {}, "region_bytes": []}
        with socket.create_connection(("127.0.0.1", p.bootstrap_port), timeout=5) as s:
            s.sendall(_frame(hello))
            rest = _read_all(s)
            seen += rest
            assert _frames(rest) == [{"v": 1, "type": "refuse", "reason": "authentication failed"}]
        for secret_word in (b"layout", b"page_size", b"ptrs", b"session", b"metadata", b"port", b"prefill-"):
            assert secret_word not in seen
        # a whole decode worker with another secret: a clear reason, no room
        other = _cfg(backend, secret=b"another-secret-of-32-bytes-xxxxx")
        with create_kv_manager("decode", _pool(False), other) as d:
            r = d.create_receiver("127.0.0.1", p.bootstrap_port, 11, room_token(11))
            r.init([1, 2])
            assert _wait(r) == KVPoll.Failed and "authentication failed" in r.failure_reason
        with create_kv_manager("decode", _pool(False), _cfg(backend, insecure=True, secret=None)) as d:
            r = d.create_receiver("127.0.0.1", p.bootstrap_port, 12)
            r.init([1, 2])
            assert _wait(r) == KVPoll.Failed and "--kv-transfer-insecure" in r.failure_reason
        assert p.server.connections() == []


def test_insecure_pair_transfers_without_tokens():
    cfg = _cfg("tcp", insecure=True, secret=None)
    with create_kv_manager("prefill", _pool(True), cfg) as p, create_kv_manager("decode", _pool(False), cfg) as d:
        s = p.create_sender(5)
        r = d.create_receiver("127.0.0.1", p.bootstrap_port, 5)
        r.init([3, 4])
        s.send([1, 2], AuxInfo(9, -0.5, 8))
        assert _wait(r) == KVPoll.Success and _wait(s) == KVPoll.Success


def test_slow_and_excess_connections_cost_at_most_the_handshake_timeout():
    cfg = _cfg("tcp", handshake_timeout=1.0, max_handshakes=3, max_connections=8)
    with create_kv_manager("prefill", _pool(True), cfg) as p:
        t0 = time.monotonic()
        slow = [socket.create_connection(("127.0.0.1", p.bootstrap_port), timeout=5) for _ in range(3)]
        for s in slow:
            s.sendall(b"\x00")  # a slowloris: one byte, then nothing
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", p.bootstrap_port), timeout=5) as extra:
            assert _read_all(extra) == b""  # over the limit: closed at once, not a word (a served one gets a Refuse)
        assert p.server.rejected == 1
        for s in slow:  # each slowloris held its thread for at most the handshake timeout
            assert _frames(_read_all(s)) == [{"v": 1, "type": "refuse", "reason": "authentication failed"}]
            s.close()
        assert time.monotonic() - t0 < 3.0
        with create_kv_manager("decode", _pool(False), cfg) as d:  # the server serves again
            s = p.create_sender(6, room_token(6))
            r = d.create_receiver("127.0.0.1", p.bootstrap_port, 6, room_token(6))
            r.init([5, 6])
            s.send([1, 2], AuxInfo(1, 0.0, 8))
            assert _wait(r) == KVPoll.Success


def test_idle_tcp_data_connections_are_closed_and_prefill_reconnects_before_its_next_frame():
    cfg = _cfg("tcp", data_idle_timeout=0.6)
    with create_kv_manager("prefill", _pool(True), cfg) as p, create_kv_manager("decode", _pool(False), cfg) as d:
        for room in (31, 32):
            s = p.create_sender(room, room_token(room))
            r = d.create_receiver("127.0.0.1", p.bootstrap_port, room, room_token(room))
            r.init([3, 4])
            s.send([1, 2], AuxInfo(4, 0.0, 8))
            assert _wait(r) == KVPoll.Success and _wait(s) == KVPoll.Success
            deadline = time.monotonic() + 5
            while d.backend._open and time.monotonic() < deadline:  # decode closes the idle connection
                time.sleep(0.02)
            assert d.backend._open == 0


def test_oversized_frames_are_refused_before_their_body_is_read():
    with create_kv_manager("prefill", _pool(True), _cfg("tcp")) as p:
        with socket.create_connection(("127.0.0.1", p.bootstrap_port), timeout=5) as s:
            s.sendall(struct.pack(">I", 513))  # over the pre-auth cap
            assert _frames(_read_all(s))[0]["reason"] == "authentication failed"
        with socket.create_connection(("127.0.0.1", p.bootstrap_port), timeout=5) as s:
            _bootstrap_auth(s, KV_SECRET)
            s.sendall(struct.pack(">I", 0xFFFFFFFF))  # over the handshake cap even when authenticated
            got = _frames(_read_all(s))
            assert got and got[0]["type"] == "refuse" and "exceeds" in got[0]["reason"]


# --- room binding ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("early", [True, False], ids=["before-the-request", "after-the-request"])
def test_a_registration_with_a_wrong_tag_is_refused_and_the_real_decode_gets_the_room(backend, early):
    _backend(backend)
    room = 4242
    with (
        create_kv_manager("prefill", _pool(True), _cfg(backend)) as p,
        create_kv_manager("decode", _pool(False), _cfg(backend)) as thief,
        create_kv_manager("decode", _pool(False), _cfg(backend)) as d,
    ):
        s = None if early else p.create_sender(room, room_token(room))
        stolen = thief.create_receiver("127.0.0.1", p.bootstrap_port, room, "a-guessed-token-0000")
        stolen.init([7, 8])  # registers first: with the secret, but without the room's token
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (stolen.poll() != KVPoll.Bootstrapping or p._pending):
            time.sleep(0.005)
        r = d.create_receiver("127.0.0.1", p.bootstrap_port, room, room_token(room))
        r.init([3, 4])
        if early:
            time.sleep(0.2)  # both registrations are held until the request arrives
            s = p.create_sender(room, room_token(room))
        s.send([1, 2], AuxInfo(17, -0.25, 8))
        assert _wait(r) == KVPoll.Success and r.aux.first_token_id == 17
        assert _wait(s) == KVPoll.Success
        assert _wait(stolen) == KVPoll.Failed and "wrong room tag" in stolen.failure_reason
        assert int(thief.pool.buffers()[0].count_nonzero()) == 0  # not one byte of the prompt's KV


# --- tcp data connections -------------------------------------------------------------------------------


class _DecodeRoom:
    """A decode manager (tcp) with one registered room whose prefill is this test (raw frames)."""

    def __init__(self, stack, room: int = 77):
        self.p = stack.enter_context(create_kv_manager("prefill", _pool(True), _cfg("tcp")))
        self.d = stack.enter_context(create_kv_manager("decode", _pool(False), _cfg("tcp")))
        self.room = room
        self.key = A.RoomKey(room, room_token(room), KV_SECRET)
        self.r = self.d.create_receiver("127.0.0.1", self.p.bootstrap_port, room, room_token(room))
        self.r.init([3, 4])
        deadline = time.monotonic() + 30
        while self.r.poll() == KVPoll.Bootstrapping and time.monotonic() < deadline:
            time.sleep(0.005)
        info = self.d.backend.local_info()
        self.addr = (info["host"], info["port"])
        self.slot = self.r.aux_slot
        self.aux_region = len(self.d.regions) - 1

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.addr, timeout=5)
        _data_auth(sock, KV_SECRET)
        return sock

    def finish_for_real(self) -> None:
        s = self.p.create_sender(self.room, room_token(self.room))
        s.send([1, 2], AuxInfo(5, -1.0, 8))
        assert _wait(self.r) == KVPoll.Success and _wait(s) == KVPoll.Success


def test_a_tcp_frame_with_a_wrong_tag_is_refused_and_the_room_goes_on():
    import contextlib

    with contextlib.ExitStack() as stack:
        t = _DecodeRoom(stack)
        page = t.d.layout.page_bytes
        with t.connect() as sock:
            sock.sendall(_tcp_frame(t.room, bytes(16), [(0, 3 * page, page)], done=False))
            assert _read_all(sock) == b""  # the connection is closed
        assert t.r.poll() == KVPoll.WaitingForInput and int(t.d.pool.buffers()[0].count_nonzero()) == 0
        with socket.create_connection(t.addr, timeout=5) as sock:  # the wrong secret never gets to send a frame
            hello = sock.recv(5 + A.NONCE_BYTES, socket.MSG_WAITALL)
            sock.sendall(b"\x01" + A.new_nonce() + bytes(32))
            assert len(hello) == 37 and _read_all(sock) == b""
        t.finish_for_real()


@pytest.mark.parametrize("what", ["empty-done", "done-before-aux", "aux-outside-own-slot", "n-over-bound"])
def test_tcp_frames_that_break_the_rules_are_rejected(what):
    import contextlib

    with contextlib.ExitStack() as stack:
        t = _DecodeRoom(stack)
        page, rec = t.d.layout.page_bytes, AUX_RECORD_BYTES
        other = (t.slot + 1) % t.d.num_aux_slots
        t.d.aux_buffer[other].fill_(0x5A)
        frames = {
            "empty-done": _tcp_frame(t.room, t.key.frame_tag, [], done=True),
            "done-before-aux": _tcp_frame(t.room, t.key.frame_tag, [(0, 3 * page, page)], done=True),
            "aux-outside-own-slot": _tcp_frame(t.room, t.key.frame_tag, [(t.aux_region, other * rec, rec)], False),
            "n-over-bound": struct.pack("<4sB3xQQ16s", b"KVT2", 0, t.room, 1 << 40, t.key.frame_tag),
        }
        with t.connect() as sock:
            sock.sendall(frames[what])
            deadline = time.monotonic() + 30
            while not t.r.poll().is_terminal and time.monotonic() < deadline:
                time.sleep(0.005)
        assert t.r.poll() == KVPoll.Failed, "the room must not succeed"
        reason = t.r.failure_reason
        assert {
            "empty-done": "done signal before the room's aux record",
            "done-before-aux": "done signal before the room's aux record",
            "aux-outside-own-slot": "outside the room's own aux record slot",
            "n-over-bound": "descriptors",
        }[what] in reason
        assert bool((t.d.aux_buffer[other] == 0x5A).all())  # another room's record is untouched


def test_a_done_signal_with_a_foreign_or_stale_aux_record_is_ignored():
    import contextlib

    with contextlib.ExitStack() as stack:
        t = _DecodeRoom(stack)
        foreign = AuxRecord(room=t.room, first_token_id=1, first_token_logprob=0.0, prompt_len=8, num_pages=2)
        stale = AuxRecord(t.room, 1, 0.0, 8, 2, tag=A.RoomKey(t.room, room_token(999), KV_SECRET).aux_tag)
        for record in (foreign, stale):
            t.d._on_backend_done(t.room, None, (t.slot, record.pack()))  # as the nixl notification thread does
            t.d._on_backend_done(t.room, None)  # a done with nothing in the slot
        time.sleep(0.05)
        assert t.r.poll() == KVPoll.WaitingForInput
        t.finish_for_real()


def test_room_tags_depend_on_secret_token_and_room():
    k = A.RoomKey(5, room_token(5), KV_SECRET)
    assert len(k.frame_tag) == 16 and len(k.aux_tag) == 16 and len(k.register_tag) == 32
    assert k.frame_tag != k.aux_tag
    for other in (
        A.RoomKey(6, room_token(5), KV_SECRET),
        A.RoomKey(5, room_token(6), KV_SECRET),
        A.RoomKey(5, room_token(5), b"x" * 16),
    ):
        assert other.frame_tag != k.frame_tag and other.register_tag != k.register_tag
    want = hmac.new(
        hmac.new(KV_SECRET, b"kvship-room|" + room_token(5).encode(), hashlib.sha256).digest(),
        b"tcp|" + (5).to_bytes(8, "big"),
        hashlib.sha256,
    ).digest()[:16]
    assert k.frame_tag == want
    assert room_token(5) not in repr(k) and "kvship" not in repr(k)
    np.testing.assert_equal(AuxRecord.unpack(AuxRecord(5, 1, 0.0, 2, 1, tag=k.aux_tag).pack()).tag, k.aux_tag)
