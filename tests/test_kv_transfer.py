"""KV transfer between two real processes, for every backend (tcp, mooncake over tcp, nixl over UCX).

A prefill process and a decode process each host real ``KVPool``s filled with
known data and KV managers built on them; the test drives both over pipes and
checks the decode pool's pages byte for byte.  Page sizes 1 and 16,
non-contiguous destination pages, aux after KV, checksum, aborts, peer death,
layout mismatch and timeouts; layer-wise sends (each layer lands once the test
signals it stored, the fallbacks, aborts and peer death mid-forward).  After each test both sides must hold no room
and every aux slot must be free again.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
import socket
import time
import traceback

import numpy as np
import pytest
import torch

from kvship.engine.disagg.base import BackendUnavailableError, get_transfer_backend

BACKENDS = ["tcp", "mooncake", "nixl"]
SMALL = dict(num_slots=512, num_kv_heads=2, head_dim=16, num_layers=3, dtype="float32")
BIG = dict(num_slots=4096, num_kv_heads=4, head_dim=64, num_layers=3, dtype="float32")  # "_big" managers
# managers each process hosts: name -> (role, page size, config overrides, fill seed)
PREFILL_MANAGERS = {
    "p1": (1, {}, 11),
    "p16": (16, {}, 12),
    "p16_corrupt": (16, {}, 12),
    "p16_short": (16, {"bootstrap_timeout": 1.0}, 12),
    "p16_big": (16, {}, 13),
    "p16_whole": (16, {"layerwise": False}, 12),
    "p16_grouped": (16, {"layerwise_writes": 2}, 12),  # 3 layers in groups of 2: [0, 2) then [2, 3)
    "p16_aux": (16, {}, 12),  # its aux staging buffer shows whether an aux record was written
}
CORRUPT_EVERY = {"p16_corrupt": 1}  # test-only fault injection (tests/kv_faults.py): every KV batch gets a wrong page
DECODE_MANAGERS = {
    "d1": (1, {}),
    "d16": (16, {}),
    "d16_checksum": (16, {"checksum": True}),
    "d16_short": (16, {"waiting_timeout": 1.0, "bootstrap_timeout": 1.0}),
    "d16_big": (16, {}),
    "d16_old": (16, {}),  # a decode worker from before ``aux_in_done`` (its endpoint does not advertise it)
    "d16_big_old": (16, {}),
}
OLD_DECODE = {"d16_old", "d16_big_old"}

os.environ.setdefault("UCX_MODULES", "^ib")  # Debian's ibverbs-providers makes UCX crash at exit


# --- the peer process ------------------------------------------------------------


def fill_pool(pool, seed: int) -> None:
    for i, buf in enumerate(pool.buffers()):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))


def make_pool(page_size: int, big: bool = False):
    from kvship.engine.mem.pools import KVPool

    kw = dict(BIG if big else SMALL)
    return KVPool(
        kw["num_slots"],
        page_size,
        getattr(torch, kw["dtype"]),
        kw["num_kv_heads"],
        kw["head_dim"],
        kw["num_layers"],
        "cpu",
    )


def _peer_main(conn, role: str, backend: str, names) -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    from kv_faults import corrupt_kv_every
    from pd_fixtures import KV_SECRET, room_token

    from kvship.engine.disagg import AuxInfo, KVTransferConfig, create_kv_manager
    from kvship.engine.disagg.layerwise import LayerProgress

    mgrs, pools, objs, expected, progress = {}, {}, {}, {}, {}
    specs = PREFILL_MANAGERS if role == "prefill" else DECODE_MANAGERS
    try:
        for name, spec in specs.items():
            if names is not None and name not in names:
                continue
            ps, overrides = spec[0], spec[1]
            pool = make_pool(ps, big="_big" in name)
            if role == "prefill":
                fill_pool(pool, spec[2])
            pools[name] = pool
            cfg = KVTransferConfig(
                backend=backend,
                bootstrap_port=0,
                heartbeat_interval=0.5,
                heartbeat_timeout=5.0,
                **{"secret": KV_SECRET, **overrides},
            )
            mgrs[name] = create_kv_manager(role, pool, cfg)
            if name in CORRUPT_EVERY:
                corrupt_kv_every(mgrs[name], CORRUPT_EVERY[name])
            if name in OLD_DECODE:
                info = mgrs[name].backend.local_info
                mgrs[name].backend.local_info = lambda info=info: {
                    k: v for k, v in info().items() if k != "aux_in_done"
                }
    except Exception:  # noqa: BLE001 - report to the test
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ok", {n: getattr(m, "bootstrap_port", None) for n, m in mgrs.items()}))

    def expected_pool(ps, seed, big):
        if (ps, seed, big) not in expected:
            expected[(ps, seed, big)] = make_pool(ps, big)
            fill_pool(expected[(ps, seed, big)], seed)
        return expected[(ps, seed, big)]

    def pages_match(mgr, dst_pages, src_seed, src_pages):
        pool = pools[mgr]
        ref = expected_pool(pool.page_size, src_seed, "_big" in mgr)
        ps = pool.page_size
        for got, want in zip(pool.buffers(), ref.buffers()):
            for d, s in zip(dst_pages, src_pages):
                if not torch.equal(got[d * ps : (d + 1) * ps], want[s * ps : (s + 1) * ps]):
                    return False
        return True

    def outside_untouched(mgr, dst_pages):
        pool = pools[mgr]
        ps = pool.page_size
        keep = torch.ones(pool.buffers()[0].shape[0], dtype=torch.bool)
        for d in dst_pages:
            keep[d * ps : (d + 1) * ps] = False
        return all(int(b[keep].count_nonzero()) == 0 for b in pool.buffers())

    def wait(room, timeout):
        o = objs[room]
        deadline = time.monotonic() + timeout
        while not o.poll().is_terminal and time.monotonic() < deadline:
            time.sleep(0.002)
        return poll(room)

    def poll(room):
        o = objs[room]
        st = o.poll()
        aux = getattr(o, "aux", None)
        return (
            int(st),
            o.failure_reason,
            None if aux is None else (aux.first_token_id, aux.first_token_logprob, aux.prompt_len, aux.room),
        )

    def wait_checking_order(mgr, room, timeout, src_seed, src_pages):
        """Poll; the moment the aux record is visible in decode memory, snapshot the first and last
        K/V buffers' destination pages (cheap), and check afterwards that they were already complete."""
        o, m = objs[room], mgrs[mgr]
        pool = pools[mgr]
        ps = pool.page_size
        rows = lambda pages: torch.tensor([p * ps + i for p in pages for i in range(ps)])  # noqa: E731
        deadline = time.monotonic() + timeout
        snap = None
        while time.monotonic() < deadline:
            slot = o.aux_slot
            if snap is None and slot is not None and bytes(m.aux_buffer[slot, :4].numpy()) == b"KVAX":
                r = rows(o.pages.tolist())
                snap = [pool.buffers()[i].index_select(0, r) for i in (0, -1)]
            if o.poll().is_terminal:
                break
            time.sleep(0.0002)
        early = None
        if snap is not None:
            ref = expected_pool(ps, src_seed, "_big" in mgr)
            early = all(
                torch.equal(got, ref.buffers()[i].index_select(0, rows(src_pages))) for got, i in zip(snap, (0, -1))
            )
        return poll(room), early

    def buffers_match(mgr, dst_pages, src_seed, src_pages, buffers):
        """Decode: buffers ``buffers`` (indices into ``pool.buffers()``) hold the source's pages."""
        pool = pools[mgr]
        ref = expected_pool(pool.page_size, src_seed, "_big" in mgr)
        ps = pool.page_size
        return all(
            torch.equal(pool.buffers()[b][d * ps : (d + 1) * ps], ref.buffers()[b][s * ps : (s + 1) * ps])
            for b in buffers
            for d, s in zip(dst_pages, src_pages)
        )

    def buffers_zero(mgr, dst_pages, buffers):
        pool = pools[mgr]
        ps = pool.page_size
        return all(
            int(pool.buffers()[b][d * ps : (d + 1) * ps].count_nonzero()) == 0 for b in buffers for d in dst_pages
        )

    def layerwise(mgr, room, pages, ready):
        progress[room] = LayerProgress(pools[mgr].num_layers, "cpu")
        return objs[room].send_layerwise(pages, ready, progress[room])

    def stats(mgr):
        m = mgrs[mgr]
        with m.lock:
            if role == "decode":
                return {"active": len(m.active), "aux_free": len(m.aux_free), "aux_total": m.num_aux_slots}
            return {"senders": len(m._senders), "pending": len(m._pending)}

    handlers = {
        "sender": lambda mgr, room: objs.__setitem__(room, mgrs[mgr].create_sender(room, room_token(room))),
        "receiver": lambda mgr, port, room: objs.__setitem__(
            room, mgrs[mgr].create_receiver("127.0.0.1", port, room, room_token(room))
        ),
        "send": lambda room, pages, aux: objs[room].send(pages, AuxInfo(*aux)),
        "init": lambda room, pages: objs[room].init(pages),
        "poll": poll,
        "wait": wait,
        "wait_checking_order": wait_checking_order,
        "abort": lambda room, reason: objs[room].abort(reason),
        "pages_match": pages_match,
        "buffers_match": buffers_match,
        "buffers_zero": buffers_zero,
        "layerwise": layerwise,
        "layer_done": lambda room, layer: progress[room].layer_done(layer),
        "layers_finish": lambda room: progress[room].finish(),
        "layers_abandon": lambda room: progress[room].abandon(),
        "outside_untouched": outside_untouched,
        "zero": lambda mgr: [b.zero_() for b in pools[mgr].buffers()] and None,
        "stats": stats,
        "aux_staging_used": lambda mgr: int(mgrs[mgr]._aux_staging.count_nonzero()) > 0,
    }
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg[0] == "exit":
            break
        try:
            conn.send(("ok", handlers[msg[0]](*msg[1:])))
        except Exception:  # noqa: BLE001 - report to the test
            conn.send(("err", traceback.format_exc()))
    for m in mgrs.values():
        m.close()
    conn.send(("ok", "bye"))
    os._exit(0)  # skip slow library teardown at interpreter exit (UCX, mooncake)


class Peer:
    """A prefill or decode process driven over a pipe."""

    def __init__(self, role: str, backend: str, names=None):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child, role, backend, names), daemon=True)
        self.proc.start()
        self.ports = self._reply(120)

    def _reply(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError("peer process did not answer")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer process error:\n{value}")
        return value

    def __call__(self, *cmd, timeout: float = 60):
        self.conn.send(cmd)
        return self._reply(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit",))
                self._reply(20)
            except (OSError, EOFError, TimeoutError, RuntimeError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(5)


FAILED, BOOTSTRAPPING, WAITING, TRANSFERRING, SUCCESS = range(5)
_rooms = iter(range(10**6, 2 * 10**6))


def new_room() -> int:
    return next(_rooms) * 7919 + (1 << 62)


def _skip_if_unavailable(backend: str) -> None:
    try:
        get_transfer_backend(backend)
    except BackendUnavailableError as e:
        print(f"SKIP {backend}: {e}")
        pytest.skip(str(e))


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request):
    backend = request.param
    _skip_if_unavailable(backend)
    p, d = Peer("prefill", backend), Peer("decode", backend)
    p.backend = d.backend = backend
    yield p, d
    p.close()
    d.close()


def wait_state(peer, room, want, timeout=20.0):
    deadline = time.time() + timeout
    while True:
        st, reason, aux = peer("poll", room)
        if st == want or st in (FAILED, SUCCESS) or time.time() > deadline:
            return st, reason, aux
        time.sleep(0.01)


def assert_clean(p, d, pm="p16", dm="d16"):
    deadline = time.time() + 10
    while True:
        ps, ds = p("stats", pm), d("stats", dm)
        ok = ps == {"senders": 0, "pending": 0} and ds["active"] == 0 and ds["aux_free"] == ds["aux_total"]
        if ok or time.time() > deadline:
            break
        time.sleep(0.05)
    assert ps == {"senders": 0, "pending": 0}
    assert ds["active"] == 0 and ds["aux_free"] == ds["aux_total"]


def transfer(p, d, pm, dm, src, dst, aux=(7, -0.25, 100)):
    room = new_room()
    d("receiver", dm, p.ports[pm], room)
    p("sender", pm, room)
    d("init", room, dst)
    p("send", room, src, aux)
    return room


# --- tests -------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
def test_pages_land_in_the_registered_slots_for_every_layer(pair, page_size):
    p, d = pair
    pm, dm = f"p{page_size}", f"d{page_size}"
    n_pages = 512 // page_size
    src = list(range(3, 3 + n_pages // 2)) + [n_pages, 1]  # one long run + stragglers
    block = list(range(n_pages - 9, n_pages - 5))  # 4 contiguous destination pages ...
    others = [int(x) for x in np.random.default_rng(page_size).permutation(np.arange(1, n_pages + 1)) if x not in block]
    dst = block + others[: len(src) - len(block)]  # ... then scattered ones
    d("zero", dm)
    room = transfer(p, d, pm, dm, src, dst, aux=(4242, -1.5, len(src) * page_size - 3))
    st, reason, aux = d("wait", room, 30)
    assert st == SUCCESS, reason
    assert aux == (4242, -1.5, len(src) * page_size - 3, room)
    assert p("wait", room, 10)[0] == SUCCESS
    assert d("pages_match", dm, dst, PREFILL_MANAGERS[pm][2], src)
    assert d("outside_untouched", dm, dst)
    assert_clean(p, d, pm, dm)


@pytest.mark.parametrize("dm", ["d16_big", "d16_big_old"])
def test_aux_record_only_becomes_visible_after_the_kv(pair, dm):
    """Where the aux record is a write (every backend to an older decode worker, all but nixl to any), the
    moment it is visible all KV has landed.  Where it rides in nixl's done notification it is placed with the
    done signal, so the poll loop may never see it before the end: then it must not have seen it early."""
    p, d = pair
    src = list(range(1, 121))  # 120 pages x 6 buffers x 16 KiB = 11 MiB
    dst = list(range(250, 130, -1))  # reversed: one descriptor per page and buffer
    seen = []
    # the poll loop catches a written record only if it runs between the write and the done signal: on a loaded
    # box that window can pass between two polls, so up to three transfers, and one catch is enough
    for _ in range(3):
        d("zero", dm)
        room = new_room()
        d("receiver", dm, p.ports["p16_big"], room)
        p("sender", "p16_big", room)
        d("init", room, dst)
        p("send", room, src, (1, 0.0, 1920))
        (st, reason, _), early = d("wait_checking_order", dm, room, 30, PREFILL_MANAGERS["p16_big"][2], src)
        assert st == SUCCESS, reason
        assert early is not False, "the aux record was visible before all KV pages had landed"
        assert d("pages_match", dm, dst, PREFILL_MANAGERS["p16_big"][2], src)
        assert_clean(p, d, "p16_big", dm)
        seen.append(early)
        if early is not None:
            break
    if p.backend != "nixl" or dm.endswith("_old"):
        assert seen[-1] is not None, "the aux record was never seen in decode memory before a transfer finished"


def test_aux_record_rides_in_the_done_signal_where_backend_and_peer_can(pair):
    """nixl sends the aux record inside its done notification to a decode worker that advertises
    ``aux_in_done`` (prefill's aux staging stays untouched), and as an aux write to one that does not (an older
    worker); the other backends always write it.  Every way gives the same record and KV."""
    p, d = pair
    src, dst = [3, 4, 9], [20, 7, 11]
    for dm in ("d16", "d16_old"):
        d("zero", dm)
        room = transfer(p, d, "p16_aux", dm, src, dst, aux=(31, -0.75, 40))
        st, reason, aux = d("wait", room, 30)
        assert st == SUCCESS, reason
        assert aux == (31, -0.75, 40, room)
        assert p("wait", room, 10)[0] == SUCCESS
        assert d("pages_match", dm, dst, PREFILL_MANAGERS["p16_aux"][2], src)
        written = p("aux_staging_used", "p16_aux")
        assert written == (p.backend != "nixl" or dm == "d16_old"), (p.backend, dm)
        assert_clean(p, d, "p16_aux", dm)


def test_checksum_passes_clean_transfers_and_fails_a_corrupted_page(pair):
    p, d = pair
    src, dst = [4, 5, 6, 9], [20, 2, 3, 11]
    good = transfer(p, d, "p16", "d16_checksum", src, dst)
    st, reason, _ = d("wait", good, 30)
    assert st == SUCCESS, reason
    bad = transfer(p, d, "p16_corrupt", "d16_checksum", src, dst)
    st, reason, aux = d("wait", bad, 30)
    assert st == FAILED and aux is None
    assert "checksum mismatch" in reason
    assert_clean(p, d, "p16_corrupt", "d16_checksum")


def test_abort_on_decode_side_fails_both_and_frees_everything(pair):
    p, d = pair
    room = new_room()
    d("receiver", "d16", p.ports["p16"], room)
    p("sender", "p16", room)
    d("init", room, [3, 4])
    assert wait_state(p, room, WAITING)[0] == WAITING
    d("abort", room, "client disconnected")
    st, reason, _ = d("wait", room, 10)
    assert st == FAILED and "client disconnected" in reason
    st, reason, _ = p("wait", room, 10)
    assert st == FAILED and "aborted by decode" in reason
    p("send", room, [1, 2], (1, 0.0, 20))  # prefill finishing late is harmless
    assert p("poll", room)[0] == FAILED
    assert_clean(p, d)


def test_abort_on_prefill_side_fails_the_receiver(pair):
    p, d = pair
    room = new_room()
    d("receiver", "d16", p.ports["p16"], room)
    p("sender", "p16", room)
    d("init", room, [3, 4])
    assert wait_state(p, room, WAITING)[0] == WAITING
    p("abort", room, "router cancelled")
    st, reason, _ = d("wait", room, 10)
    assert st == FAILED and "aborted by prefill" in reason and "router cancelled" in reason
    assert p("poll", room)[0] == FAILED
    assert_clean(p, d)


def test_page_count_mismatch_fails_with_a_clear_reason(pair):
    p, d = pair
    room = transfer(p, d, "p16", "d16", [1, 2, 3], [5, 6])
    st, reason, _ = d("wait", room, 10)
    assert st == FAILED and "page count mismatch" in reason and "3" in reason and "2" in reason
    assert p("wait", room, 10)[0] == FAILED
    assert_clean(p, d)


def test_layout_mismatch_is_refused_at_bootstrap(pair):
    p, d = pair
    room = new_room()
    d("receiver", "d1", p.ports["p16"], room)  # decode page size 1 vs prefill 16
    d("init", room, [1, 2])
    st, reason, _ = d("wait", room, 10)
    assert st == FAILED and "KV layout mismatch" in reason and "page_size 16 != 1" in reason
    assert_clean(p, d, "p16", "d1")


def test_waiting_timeout_fails_the_receiver_and_tells_prefill(pair):
    p, d = pair
    room = new_room()
    d("receiver", "d16_short", p.ports["p16"], room)
    p("sender", "p16", room)
    d("init", room, [3, 4])  # registered, but prefill never sends
    st, reason, _ = d("wait", room, 10)
    assert st == FAILED and "waiting timeout" in reason
    st, reason, _ = p("wait", room, 10)
    assert st == FAILED and "waiting timeout" in reason
    assert_clean(p, d, "p16", "d16_short")


def test_bootstrap_timeouts_on_both_sides(pair):
    p, d = pair
    lonely = new_room()
    p("sender", "p16_short", lonely)  # decode never registers
    t0 = time.time()
    st, reason, _ = p("wait", lonely, 10)
    assert st == FAILED and "bootstrap timeout" in reason and time.time() - t0 < 8
    mute = socket.create_server(("127.0.0.1", 0))  # accepts, never answers the handshake
    try:
        room = new_room()
        d("receiver", "d16_short", mute.getsockname()[1], room)
        d("init", room, [3, 4])
        st, reason, _ = d("wait", room, 10)
        assert st == FAILED and re.search("timeout|timed out", reason), reason
    finally:
        mute.close()
    assert_clean(p, d, "p16_short", "d16_short")


def test_prefill_death_fails_the_receiver_within_the_timeout(pair):
    _, d = pair
    victim = Peer("prefill", d.backend, names=["p16"])
    try:
        room = new_room()
        d("receiver", "d16", victim.ports["p16"], room)
        victim("sender", "p16", room)
        d("init", room, [7, 8, 9])
        assert wait_state(d, room, WAITING)[0] == WAITING
        victim.kill()
        t0 = time.time()
        st, reason, _ = d("wait", room, 15)
        assert st == FAILED and "disconnected" in reason
        assert time.time() - t0 < 10
        ds = d("stats", "d16")
        assert ds["active"] == 0 and ds["aux_free"] == ds["aux_total"]
    finally:
        victim.close()


def test_decode_death_fails_the_sender(pair):
    p, _ = pair
    victim = Peer("decode", p.backend, names=["d16"])
    try:
        room = new_room()
        victim("receiver", "d16", p.ports["p16"], room)
        p("sender", "p16", room)
        victim("init", room, [7, 8, 9])
        assert wait_state(p, room, WAITING)[0] == WAITING
        victim.kill()
        st, reason, _ = p("wait", room, 15)
        assert st == FAILED and "decode peer disconnected" in reason
        p("send", room, [1, 2, 3], (1, 0.0, 40))
        assert p("stats", "p16") == {"senders": 0, "pending": 0}
    finally:
        victim.close()


def test_many_concurrent_rooms_all_arrive_intact(pair):
    p, d = pair
    d("zero", "d1")
    rooms, plans = [], []
    free = list(np.random.default_rng(7).permutation(np.arange(1, 513)))
    for i in range(24):
        n = 1 + (i * 5) % 19
        src = list(range(1 + i * 3, 1 + i * 3 + n))
        dst = [int(free.pop()) for _ in range(n)]
        room = new_room()
        d("receiver", "d1", p.ports["p1"], room)
        p("sender", "p1", room)
        d("init", room, dst)
        rooms.append(room)
        plans.append((src, dst))
    for room, (src, _) in zip(rooms, plans):
        p("send", room, src, (room % 1000, -0.5, len(src)))
    for room, (src, dst) in zip(rooms, plans):
        st, reason, aux = d("wait", room, 30)
        assert st == SUCCESS, reason
        assert aux[0] == room % 1000 and aux[3] == room
    for src, dst in plans:
        assert d("pages_match", "d1", dst, PREFILL_MANAGERS["p1"][2], src)
    assert_clean(p, d, "p1", "d1")


# --- layer-wise transfer (docs/pd.md, "Layer-wise transfer") ---------------------------------
# the SMALL pools have 3 layers: buffers K0 K1 K2 V0 V1 V2
LAYER_BUFFERS = {0: [0, 3], 1: [1, 4], 2: [2, 5]}
ALL_BUFFERS = list(range(6))


def until(peer, *cmd, timeout: float = 20.0) -> bool:
    """``peer(*cmd)`` turned true within ``timeout``."""
    deadline = time.time() + timeout
    while not peer(*cmd):
        if time.time() > deadline:
            return False
        time.sleep(0.01)
    return True


def send_and_land(p, d, room, src, dst, aux, pm="p16", dm="d16"):
    """``send()`` the room's first token; both sides end in Success, decode holds prefill's pages and nothing
    is left over.  Returns decode's aux record."""
    p("send", room, src, aux)
    st, reason, got = d("wait", room, 30)
    assert st == SUCCESS, reason
    assert p("wait", room, 10)[0] == SUCCESS
    assert d("pages_match", dm, dst, PREFILL_MANAGERS[pm][2], src)
    assert_clean(p, d, pm, dm)
    return got


def layerwise_room(p, d, src, dst, pm="p16", dm="d16"):
    room = new_room()
    d("receiver", dm, p.ports[pm], room)
    p("sender", pm, room)
    d("init", room, dst)
    assert wait_state(p, room, WAITING)[0] == WAITING
    return room


def test_layerwise_send_writes_each_layer_as_it_is_stored(pair):
    p, d = pair
    seed = PREFILL_MANAGERS["p16"][2]
    src, dst = [5, 6, 7, 8, 12, 13], [30, 31, 2, 9, 10, 11]
    ready, rest_src, rest_dst = 2, src[2:], dst[2:]
    d("zero", "d16")
    room = layerwise_room(p, d, src, dst)
    assert p("layerwise", "p16", room, src, ready) is True
    # the pages complete before the forward go at once, every layer; the others wait for their layer
    assert until(d, "buffers_match", "d16", dst[:ready], seed, src[:ready], ALL_BUFFERS)
    assert d("buffers_zero", "d16", rest_dst, ALL_BUFFERS)
    p("layer_done", room, 0)
    assert until(d, "buffers_match", "d16", rest_dst, seed, rest_src, LAYER_BUFFERS[0])
    assert d("buffers_zero", "d16", rest_dst, LAYER_BUFFERS[1] + LAYER_BUFFERS[2])
    assert d("poll", room)[0] != SUCCESS
    p("layer_done", room, 1)
    p("layers_finish", room)  # the model returned: layer 2 is stored too
    p("send", room, src, (31, -0.75, 90))
    st, reason, aux = d("wait", room, 30)
    assert st == SUCCESS, reason
    assert aux == (31, -0.75, 90, room)
    assert p("wait", room, 10)[0] == SUCCESS
    assert d("pages_match", "d16", dst, seed, src)
    assert d("outside_untouched", "d16", dst)
    assert_clean(p, d)


def test_layerwise_send_in_groups_writes_a_group_once_its_last_layer_is_stored(pair):
    """``layerwise_writes``: with 3 layers in 2 groups, layer 0 alone moves nothing; layer 1 moves 0 and 1."""
    p, d = pair
    seed = PREFILL_MANAGERS["p16_grouped"][2]
    src, dst = [5, 6, 7], [30, 31, 2]
    d("zero", "d16")
    room = layerwise_room(p, d, src, dst, pm="p16_grouped")
    assert p("layerwise", "p16_grouped", room, src, 0) is True
    p("layer_done", room, 0)
    time.sleep(0.3)
    assert d("buffers_zero", "d16", dst, ALL_BUFFERS)  # the group is not complete: nothing written yet
    p("layer_done", room, 1)
    assert until(d, "buffers_match", "d16", dst, seed, src, LAYER_BUFFERS[0] + LAYER_BUFFERS[1])
    assert d("buffers_zero", "d16", dst, LAYER_BUFFERS[2])
    p("layers_finish", room)
    send_and_land(p, d, room, src, dst, (7, -0.5, 3), pm="p16_grouped")


def test_layerwise_falls_back_where_it_cannot_apply(pair):
    p, d = pair
    src, dst = [4, 5, 6], [20, 21, 3]
    checked = layerwise_room(p, d, src, dst, dm="d16_checksum")
    assert p("layerwise", "p16", checked, src, 0) is False  # a checksum is asked for
    off = layerwise_room(p, d, src, dst, pm="p16_whole")
    assert p("layerwise", "p16_whole", off, src, 0) is False  # layer-wise is off
    first = layerwise_room(p, d, src, dst)
    second = layerwise_room(p, d, [7, 8, 9], [14, 15, 16])
    assert p("layerwise", "p16", first, src, 0) is True
    assert p("layerwise", "p16", second, [7, 8, 9], 0) is False  # one of the 2 threads stays for whole sends
    p("layers_finish", first)
    for room, pages in ((checked, src), (off, src), (first, src), (second, [7, 8, 9])):
        p("send", room, pages, (1, 0.0, 48))
        st, reason, _ = d("wait", room, 30)
        assert st == SUCCESS, reason
    assert d("pages_match", "d16", [14, 15, 16], PREFILL_MANAGERS["p16"][2], [7, 8, 9])
    assert_clean(p, d)
    assert_clean(p, d, "p16_whole", "d16_checksum")


def test_a_room_registered_after_the_forward_started_goes_layer_wise_from_then(pair):
    """``send_layerwise`` before decode registers: the writes start with the registration, every layer stored by
    then at once; a registration that asks for a checksum turns the room into a whole send after ``send``."""
    p, d = pair
    seed = PREFILL_MANAGERS["p16"][2]
    src, dst = [5, 6, 7], [30, 31, 2]
    d("zero", "d16")
    room = new_room()
    p("sender", "p16", room)
    assert p("layerwise", "p16", room, src, 0) is True  # decode has not registered yet
    p("layer_done", room, 0)
    p("layer_done", room, 1)
    assert p("poll", room)[0] == BOOTSTRAPPING
    d("receiver", "d16", p.ports["p16"], room)
    d("init", room, dst)
    # layers 0 and 1 were stored before the registration: they go at once; layer 2 waits for its store
    assert until(d, "buffers_match", "d16", dst, seed, src, LAYER_BUFFERS[0] + LAYER_BUFFERS[1])
    assert d("buffers_zero", "d16", dst, LAYER_BUFFERS[2])
    p("layers_finish", room)
    assert send_and_land(p, d, room, src, dst, (9, -0.25, 5)) == (9, -0.25, 5, room)
    # registered only after the forward and send(): everything goes at the registration
    d("zero", "d16")
    room = new_room()
    p("sender", "p16", room)
    assert p("layerwise", "p16", room, src, 0) is True
    p("layers_finish", room)
    p("send", room, src, (3, 0.0, 1))
    d("receiver", "d16", p.ports["p16"], room)
    d("init", room, dst)
    st, reason, _ = d("wait", room, 30)
    assert st == SUCCESS, reason
    assert p("wait", room, 10)[0] == SUCCESS
    assert d("pages_match", "d16", dst, seed, src)
    assert_clean(p, d)
    # the registration asks for a checksum (computed over the whole KV): the whole send after send()
    room = new_room()
    p("sender", "p16", room)
    assert p("layerwise", "p16", room, src, 0) is True
    p("layer_done", room, 0)
    d("receiver", "d16_checksum", p.ports["p16"], room)
    d("init", room, dst)
    assert wait_state(p, room, WAITING)[0] == WAITING  # a whole send now: it waits for send()
    p("layers_finish", room)
    send_and_land(p, d, room, src, dst, (4, 0.0, 2), dm="d16_checksum")
    # never registered: the bootstrap timeout fails it and frees it, as any room
    room = new_room()
    p("sender", "p16_short", room)
    assert p("layerwise", "p16_short", room, src, 0) is True
    p("layers_finish", room)
    p("send", room, src, (4, 0.0, 2))
    st, reason, _ = wait_state(p, room, FAILED, timeout=10)
    assert st == FAILED and "bootstrap timeout" in reason
    assert_clean(p, d, pm="p16_short")


def test_decode_abort_and_an_abandoned_forward_end_a_layerwise_send_cleanly(pair):
    p, d = pair
    src, dst = [4, 5, 6], [20, 21, 3]
    room = layerwise_room(p, d, src, dst)
    assert p("layerwise", "p16", room, src, 1) is True
    p("layer_done", room, 0)
    d("abort", room, "client disconnected")  # the transfer thread waits for layer 1: it must let go
    st, reason, _ = d("wait", room, 10)
    assert st == FAILED and "client disconnected" in reason
    st, reason, _ = p("wait", room, 10)
    assert st == FAILED and "aborted by decode" in reason
    p("layers_finish", room)
    p("send", room, src, (1, 0.0, 48))  # the forward ending late is harmless
    assert p("poll", room)[0] == FAILED
    assert_clean(p, d)
    room = layerwise_room(p, d, src, dst)
    assert p("layerwise", "p16", room, src, 0) is True
    p("layers_abandon", room)  # the forward raised
    st, reason, _ = d("wait", room, 10)
    assert st == FAILED and "prefill forward failed" in reason
    assert p("wait", room, 10)[0] == FAILED
    assert_clean(p, d)


def test_peer_death_during_a_layerwise_send_frees_everything(pair):
    p, d = pair
    src, dst = [4, 5, 6], [20, 21, 3]
    victim = Peer("decode", p.backend, names=["d16"])
    try:
        room = layerwise_room(p, victim, src, dst)
        assert p("layerwise", "p16", room, src, 0) is True
        p("layer_done", room, 0)
        victim.kill()
        st, reason, _ = p("wait", room, 15)
        assert st == FAILED and ("disconnected" in reason or "transfer to decode" in reason)  # or the layer 0 write
        assert p("stats", "p16") == {"senders": 0, "pending": 0}
    finally:
        victim.close()
    victim = Peer("prefill", d.backend, names=["p16"])
    try:
        room = layerwise_room(victim, d, src, dst)
        assert victim("layerwise", "p16", room, src, 0) is True
        victim("layer_done", room, 0)
        victim.kill()
        st, reason, _ = d("wait", room, 15)
        assert st == FAILED and "disconnected" in reason
        ds = d("stats", "d16")
        assert ds["active"] == 0 and ds["aux_free"] == ds["aux_total"]
    finally:
        victim.close()
    room = layerwise_room(p, d, src, dst)  # the transfer threads are free: the next room goes through
    assert p("layerwise", "p16", room, src, 0) is True
    p("layers_finish", room)
    p("send", room, src, (1, 0.0, 48))
    assert d("wait", room, 30)[0] == SUCCESS
    assert_clean(p, d)


def test_nixl_notification_parsing_takes_both_forms_and_ignores_the_rest():
    from kvship.engine.disagg.nixl import parse_notif

    record = b"KVAX\x00:\xff" + bytes(range(20))  # binary, with the separator inside
    assert parse_notif(b"kvship-done:42") == (42, None)
    assert parse_notif(b"kvship-aux:42:7:" + record) == (42, (7, record))
    for bad in (b"kvship-done:x", b"kvship-aux:42", b"kvship-aux:a:7:r", b"other:1", b""):
        assert parse_notif(bad) is None, bad
