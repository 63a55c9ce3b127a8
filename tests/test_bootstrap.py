"""Control plane of the KV transfer layer: wire types, handshake, descriptors, checksum, registry.

In-process and on loopback; the backends' data planes are exercised across
processes in test_kv_transfer.py.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

import numpy as np
import pytest
import torch
from pd_fixtures import KV_SECRET, room_token

from kvship.engine.config import ServerArgs
from kvship.engine.disagg import (
    BackendUnavailableError,
    KVPoll,
    KVTransferConfig,
    KVTransferError,
    create_kv_manager,
    get_transfer_backend,
)
from kvship.engine.disagg import descriptors as D
from kvship.engine.disagg.bootstrap import BootstrapLink, BootstrapServer
from kvship.engine.disagg.checksum import kv_checksum
from kvship.engine.disagg.wire import (
    AUX_RECORD_BYTES,
    Abort,
    AbortAck,
    AuxRecord,
    Done,
    Fail,
    Hello,
    KVLayout,
    Ping,
    Refuse,
    Register,
    Started,
    Welcome,
    WireError,
    decode_body,
    encode_frame,
)
from kvship.engine.mem.pools import KVPool

LAYOUT = KVLayout(page_size=16, kv_dtype="bfloat16", num_layers=30, num_kv_heads=3, head_dim=64)


def _roundtrip(msg):
    frame = encode_frame(msg)
    return decode_body(frame[4:])


def test_every_control_message_survives_encode_and_decode():
    pages = np.array([5, 9, 10, 11, 2], dtype=np.int64)
    msgs = [
        Hello(peer_id="d-1", backend="tcp", layout=LAYOUT, region_bytes=[1, 2], backend_info={"port": 5}),
        Welcome(prefill_id="p", backend="nixl", layout=LAYOUT, backend_info={}),
        Refuse(reason="no"),
        Started(room=2**63 - 1),
        Done(room=1),
        Fail(room=3, reason="x"),
        Abort(room=4, reason="y"),
        AbortAck(room=5),
        Ping(),
    ]
    for m in msgs:
        assert _roundtrip(m) == m
    reg = _roundtrip(Register(room=7, pages=pages, aux_slot=3, checksum="crc32"))
    assert isinstance(reg, Register) and reg.room == 7 and reg.aux_slot == 3 and reg.checksum == "crc32"
    assert reg.pages.tolist() == pages.tolist()


@pytest.mark.parametrize(
    "body, needle",
    [
        (b"\xff\xfe", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (b'{"v": 99, "type": "ping"}', "version 99"),
        (b'{"v": 1, "type": "bogus"}', "unknown control message"),
        (b'{"v": 1, "type": "fail", "room": 1}', "missing field 'reason'"),
        (b'{"v": 1, "type": "done", "room": -4}', "non-negative"),
        (b'{"v": 1, "type": "register", "room": 1, "aux_slot": 0, "pages": "!!"}', "bad page list"),
        (
            b'{"v": 1, "type": "welcome", "prefill_id": "p", "backend": "tcp", "layout": {"kv_dtype": "nope"}}',
            "kv_dtype",
        ),
    ],
)
def test_malformed_control_frames_raise_wire_error_naming_the_problem(body, needle):
    with pytest.raises(WireError, match=needle):
        decode_body(body)


def test_aux_record_is_64_bytes_and_detects_a_missing_record():
    rec = AuxRecord(
        room=2**62 + 5,
        first_token_id=49151,
        first_token_logprob=-0.125,
        prompt_len=4096,
        num_pages=256,
        checksum=0xFFFF_FFFF_FFFF_FFFE,
    )
    raw = rec.pack()
    assert len(raw) == AUX_RECORD_BYTES
    assert AuxRecord.unpack(raw) == rec
    assert AuxRecord.unpack(AuxRecord(1, 2, 0.0, 3, 1).pack()).checksum is None
    with pytest.raises(WireError, match="did not arrive"):
        AuxRecord.unpack(bytes(AUX_RECORD_BYTES))


def test_layout_mismatch_lists_every_difference():
    other = KVLayout(page_size=1, kv_dtype="float32", num_layers=30, num_kv_heads=3, head_dim=64)
    msg = LAYOUT.mismatch(other)
    assert "page_size 16 != 1" in msg and "kv_dtype bfloat16 != float32" in msg and "head_dim" not in msg
    assert LAYOUT.mismatch(LAYOUT) is None
    assert LAYOUT.page_bytes == 16 * 3 * 64 * 2


def test_page_runs_merge_only_where_both_sides_are_contiguous():
    src = np.array([1, 2, 3, 4, 9, 10, 11])
    dst = np.array([20, 21, 5, 6, 7, 8, 30])
    runs = D.page_runs(src, dst)
    assert runs.tolist() == [[1, 20, 2, 0], [3, 5, 2, 2], [9, 7, 2, 4], [11, 30, 1, 6]]
    descs = D.kv_descs(runs, num_buffers=4, page_bytes=100)
    assert len(descs) == 16 and descs.nbytes == 4 * 7 * 100
    contiguous = D.kv_descs(D.page_runs(np.arange(1, 257), np.arange(300, 556)), num_buffers=60, page_bytes=8)
    assert len(contiguous) == 60  # one descriptor per buffer for a contiguous request
    with pytest.raises(KVTransferError, match="page count mismatch"):
        D.page_runs(np.array([1, 2]), np.array([3]))


@pytest.mark.parametrize(
    "pages, needle", [([0, 1], "padding page"), ([5, 99], "beyond"), ([3, 3], "twice"), ([], "empty")]
)
def test_bad_page_lists_are_refused(pages, needle):
    with pytest.raises(KVTransferError, match=needle):
        D.check_pages(np.array(pages, dtype=np.int64), num_pages=10, side="decode")


def test_descriptors_outside_a_registered_region_are_refused():
    descs = D.kv_descs(D.page_runs(np.array([1]), np.array([9])), num_buffers=2, page_bytes=64)
    D.check_descs(descs, local_sizes=[640, 640], remote_sizes=[640, 640])
    with pytest.raises(KVTransferError, match="destination descriptor outside"):
        D.check_descs(descs, local_sizes=[640, 640], remote_sizes=[600, 640])


def _pool(page_size=4, dtype=torch.float32, layers=2):
    pool = KVPool(64, page_size, dtype, 2, 8, layers, "cpu")
    g = torch.Generator().manual_seed(1)
    for b in pool.buffers():
        b.copy_(torch.randn(b.shape, generator=g).to(dtype))
    return pool


@pytest.mark.parametrize("algo", ["crc32", "wsum64"])
def test_checksum_follows_prompt_order_not_placement_and_catches_corruption(algo):
    a, b = _pool(), _pool()
    for buf in b.buffers():
        buf.zero_()
    src, dst = np.array([1, 2, 3, 7]), np.array([9, 4, 5, 12])
    ps = a.page_size
    for sb, db in zip(a.buffers(), b.buffers()):
        for s, d in zip(src, dst):
            db[d * ps : (d + 1) * ps] = sb[s * ps : (s + 1) * ps]
    ref = kv_checksum(a.buffers(), src, ps, algo)
    assert kv_checksum(b.buffers(), dst, ps, algo) == ref
    swapped = np.array([9, 5, 4, 12])
    assert kv_checksum(b.buffers(), swapped, ps, algo) != ref
    b.buffers()[3][12 * ps + 1, 1, 5] += 1.0
    assert kv_checksum(b.buffers(), dst, ps, algo) != ref


def test_wsum64_handles_bf16_and_is_stable():
    a = _pool(page_size=1, dtype=torch.bfloat16)
    pages = np.array([3, 1, 2])
    assert kv_checksum(a.buffers(), pages, 1, "wsum64") == kv_checksum(a.buffers(), pages, 1, "wsum64")
    with pytest.raises(ValueError, match="unknown KV checksum"):
        kv_checksum(a.buffers(), pages, 1, "md5")


# --- handshake over loopback ---------------------------------------------------


class _Link:
    """Collects a BootstrapLink's callbacks."""

    def __init__(self, port, layout=LAYOUT, backend="tcp", handshake_timeout=5.0):
        self.ready = threading.Event()
        self.closed = threading.Event()
        self.reason = None
        self.messages = []
        hello = Hello(peer_id="d-1", backend=backend, layout=layout, region_bytes=[], backend_info={})
        self.link = BootstrapLink(
            "127.0.0.1",
            port,
            hello,
            secret=KV_SECRET,
            connect_timeout=5,
            handshake_timeout=handshake_timeout,
            check_welcome=lambda w: LAYOUT.mismatch(w.layout),
            on_ready=lambda l: self.ready.set(),
            on_message=lambda l, m: self.messages.append(m),
            on_closed=self._closed,
        )

    def _closed(self, link, reason):
        self.reason = reason
        self.closed.set()


@pytest.fixture
def server():
    events = {"closed": threading.Event(), "messages": [], "reason": None}

    def on_hello(conn, hello):
        problem = LAYOUT.mismatch(hello.layout)
        return (
            Refuse(reason=f"KV layout mismatch: {problem}")
            if problem
            else Welcome(prefill_id="p", backend="tcp", layout=LAYOUT)
        )

    def on_closed(conn, reason):
        events["reason"] = reason
        events["closed"].set()

    srv = BootstrapServer(
        "127.0.0.1",
        0,
        on_hello=on_hello,
        on_message=lambda c, m: events["messages"].append(m),
        on_closed=on_closed,
        secret=KV_SECRET,
        handshake_timeout=2.0,
    )
    srv.events = events
    yield srv
    srv.close()


def test_handshake_then_messages_flow_and_heartbeats_keep_the_link_alive(server):
    c = _Link(server.port)
    assert c.ready.wait(5)
    assert c.link.send(Register(room=1, pages=np.array([1, 2]), aux_slot=0))
    for _ in range(3):
        time.sleep(0.15)
        server.tick(interval=0.1, timeout=1.0)
        c.link.tick(interval=0.1, timeout=1.0)
    deadline = time.time() + 5
    while not any(isinstance(m, Register) for m in server.events["messages"]) and time.time() < deadline:
        time.sleep(0.01)
    assert any(isinstance(m, Register) for m in server.events["messages"])
    assert any(isinstance(m, Ping) for m in c.messages) and not c.closed.is_set()
    c.link.close()
    assert server.events["closed"].wait(5)


def test_layout_mismatch_is_refused_with_the_reason(server):
    c = _Link(
        server.port, layout=KVLayout(page_size=1, kv_dtype="bfloat16", num_layers=30, num_kv_heads=3, head_dim=64)
    )
    assert c.closed.wait(5) and not c.ready.is_set()
    assert "refused the handshake" in c.reason and "page_size 16 != 1" in c.reason


def test_silent_peer_is_declared_dead_after_heartbeat_timeout(server):
    c = _Link(server.port)
    assert c.ready.wait(5)
    time.sleep(0.4)
    c.link.tick(interval=10.0, timeout=0.3)  # the server never pinged: silent for > 0.3 s
    assert c.closed.wait(5)
    assert "no heartbeat" in c.reason


def test_garbage_on_the_bootstrap_port_does_not_hurt_the_server(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"\x00\x00\x00\x05hello")
        s.settimeout(5)
        assert s.recv(4096)  # a Refuse frame naming the protocol error, then EOF
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(b"\xff\xff\xff\xff")  # absurd frame length
    c = _Link(server.port)
    assert c.ready.wait(5)  # still serving
    c.link.close()


def test_unreachable_prefill_fails_the_link_with_the_address():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    c = _Link(port)
    assert c.closed.wait(5)
    assert f"127.0.0.1:{port}" in c.reason and "cannot reach" in c.reason


def test_mute_prefill_times_out_the_handshake():
    srv = socket.create_server(("127.0.0.1", 0))
    try:
        c = _Link(srv.getsockname()[1], handshake_timeout=0.5)
        assert c.closed.wait(5)
        assert "timed out" in c.reason
    finally:
        srv.close()


# --- managers in one process (tcp), registry, config ----------------------------


def test_receiver_fails_fast_when_prefill_refuses_the_layout():
    cfg = KVTransferConfig(backend="tcp", bootstrap_port=0, secret=KV_SECRET)
    with (
        create_kv_manager("prefill", _pool(page_size=4), cfg) as p,
        create_kv_manager("decode", _pool(page_size=2), cfg) as d,
    ):
        r = d.create_receiver("127.0.0.1", p.bootstrap_port, 5, room_token(5))
        r.init([1, 2])
        deadline = time.time() + 10
        while not r.poll().is_terminal and time.time() < deadline:
            time.sleep(0.01)
        assert r.poll() == KVPoll.Failed
        assert "KV layout mismatch" in r.failure_reason and "page_size 4 != 2" in r.failure_reason
        assert d.aux_free and len(d.aux_free) == d.num_aux_slots and not d.active


def test_missing_backend_package_gives_an_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    monkeypatch.setitem(sys.modules, "nixl._api", None)
    with pytest.raises(BackendUnavailableError, match="mooncake-transfer-engine-non-cuda"):
        get_transfer_backend("mooncake")
    with pytest.raises(BackendUnavailableError, match="pip|Install `nixl`"):
        get_transfer_backend("nixl")
    with pytest.raises(ValueError, match="unknown KV transfer backend"):
        get_transfer_backend("carrier-pigeon")
    assert get_transfer_backend("tcp").name == "tcp"


def test_config_comes_from_server_args_flags(monkeypatch):
    monkeypatch.setenv("KVSHIP_KV_TRANSFER_SECRET", KV_SECRET.decode())
    args = ServerArgs(
        mode="prefill",
        disaggregation_transfer_backend="nixl",
        disaggregation_bootstrap_port=9100,
        disaggregation_bootstrap_timeout=12.0,
        disaggregation_waiting_timeout=34.0,
        kv_transfer_checksum=True,
        host="0.0.0.0",
    )
    cfg = KVTransferConfig.from_server_args(args)
    assert (cfg.backend, cfg.bootstrap_port, cfg.bootstrap_timeout, cfg.waiting_timeout, cfg.checksum, cfg.host) == (
        "nixl",
        9100,
        12.0,
        34.0,
        True,
        "0.0.0.0",
    )
    assert cfg.secret == KV_SECRET and not cfg.insecure
    with pytest.raises(ValueError, match="waiting_timeout"):
        KVTransferConfig(waiting_timeout=0, secret=KV_SECRET).validate()
