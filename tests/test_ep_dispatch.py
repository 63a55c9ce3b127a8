"""The ``static`` expert-parallel dispatch and two-batch overlap on CPU (gloo, real rank processes).

One group of 2 rank processes and one of 4 (``run_ranks``) run a MoE layer of
8 experts (top-2) with every dispatch: ``all_reduce`` (the reference),
``static`` (tokens to their experts' ranks through fixed-capacity buffers,
counts on the device) and both with ``--enable-two-batch-overlap``, over
random routing, idle experts, skewed routing (every token to the first or to
the last rank's experts), an empty batch and batch sizes that do not divide
by the rank count (ranks with no token of their own).  Every rank must end
with the reference's whole output: float32 equal within ``ATOL`` (``static``
bit-equal at two ranks: a + b = b + a), bfloat16 within one bf16 rounding
(measured 0).  The 2-rank group also runs a tiny Qwen3-MoE at ``--tp-size 2 --ep-size 2`` with each
setting (prefill logits, greedy tokens, a batched decode) and the static
dispatch over physical expert ids of an EPLB layer.  Unit tests: the packing
runs on the meta device (no value is read on the host), the capture-safety
declarations, a captured-like step keeps the static path, startup errors.
About 12 s on 2 cores when idle (24 s with other jobs running).
"""

from __future__ import annotations

import pytest
import torch
from conftest import KVDriver
from moe_fixtures import build_tiny_moe
from server_fixtures import free_port, rank_body, run_ranks

from kvship.engine.config import ServerArgs

ATOL = 1e-5  # outputs ~1: float32 rounding of sums over other row sets (two-batch overlap) and rank orders
BF16_RTOL = 2**-7  # one bf16 rounding of the largest output (cross-rank sum: bf16 collective there, fp32 here)
RANK_TIMEOUT_S = 180
E, K, H, INTER = 8, 2, 32, 16
SIZES = (0, 1, 3, 7, 16)
ROUTINGS = ("random", "idle_experts", "skewed_first", "skewed_last")
# setting -> (dispatch, two-batch overlap); the first is the reference
SETTINGS = {"all_reduce": ("all_reduce", False), "static": ("static", False),
            "static_tbo": ("static", True), "all_reduce_tbo": ("all_reduce", True)}  # fmt: skip
PROMPTS = [[5, 17, 33, 101, 7, 250, 64, 9, 12], [40, 41, 42, 300, 2, 77]]
GREEDY_TOKENS = 6


def _sa(path: str, tp: int = 1, ep: int = 1, dispatch: str = "all_reduce", tbo: bool = False) -> ServerArgs:
    return ServerArgs(
        model_path=path, device="cpu", max_total_tokens=512, max_running_requests=8, tp_size=tp, ep_size=ep,
        ep_dispatch=dispatch, enable_two_batch_overlap=tbo,
    )  # fmt: skip


def _inputs(m: int, routing: str, n: int, dtype=torch.float32):
    """Weights, tokens and router logits of one case (the same on every rank and in the test)."""
    g = torch.Generator().manual_seed(1000 * m + ROUTINGS.index(routing))
    w13, w2 = 0.2 * torch.randn(E, 2 * INTER, H, generator=g), 0.2 * torch.randn(E, H, INTER, generator=g)
    x, logits = torch.randn(m, H, generator=g), torch.randn(m, E, generator=g)
    per = E // n
    if routing == "idle_experts":
        logits[:, [1, 6]] = -30.0  # never picked
    elif routing == "skewed_first":
        logits[:, per:] = -30.0  # every pair to rank 0's experts (top-2 of its 2+ experts)
    elif routing == "skewed_last":
        logits[:, : E - per] = -30.0
    return w13.to(dtype), w2.to(dtype), x.to(dtype), logits.to(dtype)


def _layer(tp, n: int, dispatch: str, tbo: bool, w13, w2, slots: int = 0):
    from kvship.engine.layers.moe.layer import FusedMoE
    from kvship.engine.parallel.ep import ParallelFusedMoE

    base = FusedMoE(E, K, H, INTER, renormalize=True, dtype=w13.dtype, runner="torch")
    if slots:
        from kvship.engine.parallel.eplb import EPLBFusedMoE

        layer = EPLBFusedMoE(base, tp, n, dispatch, num_redundant=slots)
    else:
        layer = ParallelFusedMoE(base, tp, n, dispatch)
    layer.two_batch_overlap = tbo
    for ex in range(E):  # the loader's calls: every checkpoint expert, the rank keeps its own
        layer.w13_weight.weight_loader(layer.w13_weight, w13[ex, :INTER], (ex, "gate"))
        layer.w13_weight.weight_loader(layer.w13_weight, w13[ex, INTER:], (ex, "up"))
        layer.w2_weight.weight_loader(layer.w2_weight, w2[ex], (ex, "down"))
    return layer


def _layer_cases(tp) -> dict:
    n = tp.size
    out = {}
    with torch.no_grad():
        for routing in ROUTINGS:
            for m in SIZES:
                w13, w2, x, logits = _inputs(m, routing, n)
                for name, (dispatch, tbo) in SETTINGS.items():
                    out[(routing, m, name)] = _layer(tp, n, dispatch, tbo, w13, w2)(x, logits)
        for name in ("all_reduce", "static", "static_tbo"):  # bfloat16 activations and weights
            w13, w2, x, logits = _inputs(16, "random", n, torch.bfloat16)
            out[("bf16", 16, name)] = _layer(tp, n, *SETTINGS[name], w13, w2)(x, logits).float()
    return out


def _model_runs(path: str, groups) -> dict:
    from kvship.engine.model_runner import ModelRunner

    res = {}
    for name, (dispatch, tbo) in SETTINGS.items():
        runner = ModelRunner(_sa(path, 2, 2, dispatch, tbo), groups=groups)
        drv = KVDriver(runner)
        req = drv.new()
        try:
            prefill = drv.extend([req], [PROMPTS[0]], all_logits=True)
        finally:
            drv.free(req)
        greedy = [drv.greedy(p, GREEDY_TOKENS) for p in PROMPTS]
        a, b = drv.new(), drv.new()
        try:
            drv.extend([a, b], PROMPTS)
            decode = drv.decode([a, b], [3, 4])
        finally:
            drv.free(a)
            drv.free(b)
        res[name] = {"prefill": prefill, "greedy": greedy, "decode": decode}
    return res


def _eplb_cases(tp) -> dict:
    """An EPLB layer (2 redundant slots: 5 physical experts per rank) routes physical ids through each dispatch."""
    w13, w2, x, logits = _inputs(7, "random", tp.size)
    with torch.no_grad():
        return {name: _layer(tp, tp.size, "static" if "static" in name else "all_reduce", "tbo" in name, w13, w2, 2)(
            x, logits) for name in SETTINGS}  # fmt: skip


def _numpy(obj):
    """Tensors as numpy arrays (a tensor through the result queue would need its sender alive), recursively."""
    if isinstance(obj, dict):
        return {k: _numpy(v) for k, v in obj.items()}
    return obj.numpy() if isinstance(obj, torch.Tensor) else obj


def _tensors(obj):
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    return torch.from_numpy(obj) if hasattr(obj, "dtype") and hasattr(obj, "shape") else obj


def _rank_main(rank: int, init_method: str, world: int, path, out) -> None:
    def body(groups) -> dict:
        res = {"layer": _layer_cases(groups.tp)}
        if path is not None:
            res["model"] = _model_runs(path, groups)
            res["eplb"] = _eplb_cases(groups.tp)
        return _numpy(res)

    rank_body(rank, init_method, _sa("", world), body, out)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    return build_tiny_moe(str(tmp_path_factory.mktemp("epd_qwen3")), "qwen3_moe", seed=61)


@pytest.fixture(scope="module")
def ranks2(moe_path) -> list[dict]:
    return [_tensors(r) for r in run_ranks(_rank_main, 2, (2, moe_path), RANK_TIMEOUT_S)]


@pytest.fixture(scope="module")
def ranks4() -> list[dict]:
    return [_tensors(r) for r in run_ranks(_rank_main, 4, (4, None), RANK_TIMEOUT_S)]


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() if a.numel() else 0.0


def _want(m: int, routing: str, n: int) -> torch.Tensor:
    from kvship.engine.layers.moe.runner import get_moe_runner
    from kvship.engine.layers.moe.topk import select_experts

    w13, w2, x, logits = _inputs(m, routing, n)
    return get_moe_runner("torch")(x, w13, w2, *select_experts(logits, K, renormalize=True))


@pytest.mark.parametrize("world", [2, 4])
def test_static_dispatch_and_two_batch_overlap_equal_the_all_reduce_dispatch_on_every_rank(world, request):
    everyone = request.getfixturevalue(f"ranks{world}")
    assert len(everyone) == world
    for routing in ROUTINGS:
        for m in SIZES:
            want = _want(m, routing, world)
            ref = everyone[0]["layer"][(routing, m, "all_reduce")]
            assert ref.shape == (m, H) and _diff(ref, want) < 1e-4, (routing, m)
            for rank, res in enumerate(everyone):
                for name in SETTINGS:
                    got = res["layer"][(routing, m, name)]
                    assert got.shape == (m, H), (rank, routing, m, name)
                    diff = _diff(got, ref)
                    assert diff < ATOL, (rank, routing, m, name, diff)
    for rank, res in enumerate(everyone):
        ref = everyone[0]["layer"][("bf16", 16, "all_reduce")]
        for name in ("static", "static_tbo"):
            got = res["layer"][("bf16", 16, name)]
            assert (got - ref).abs().max().item() <= BF16_RTOL * ref.abs().max().item(), (rank, name)


def test_static_dispatch_at_two_ranks_is_bit_equal_to_the_all_reduce_dispatch_in_float32(ranks2):
    """Two partials summed: a + b is b + a, and the partials are the all-reduce dispatch's."""
    for res in ranks2:
        for (routing, m, name), got in res["layer"].items():
            if name == "static" and routing != "bf16":
                assert torch.equal(got, ranks2[0]["layer"][(routing, m, "all_reduce")]), (routing, m)


def test_tiny_qwen3_moe_gives_the_same_greedy_tokens_with_every_dispatch(ranks2):
    runs = ranks2[0]["model"]
    ref = runs["all_reduce"]
    for name, got in runs.items():
        assert got["greedy"] == ref["greedy"], name
        assert (got["prefill"] - ref["prefill"]).abs().max().item() < 1e-4, name
        assert (got["decode"] - ref["decode"]).abs().max().item() < 1e-4, name
    assert ranks2[1]["model"]["static_tbo"]["greedy"] == ref["greedy"]  # rank 1 computed the same


def test_the_static_dispatch_takes_an_eplb_layers_physical_ids(ranks2):
    ref = _want(7, "random", 2)
    for res in ranks2:
        for name, got in res["eplb"].items():
            assert (got - ref).abs().max().item() < 1e-4, name


# --- no processes --------------------------------------------------------------------------------------------
def test_packing_reads_no_value_on_the_host():
    """``pack`` and ``unpack`` run on the meta device (no data: any host read would raise), sizes from ``M``."""
    from kvship.engine.parallel.ep_dispatch import pack, split_rows, unpack

    m, n, k, h = 7, 4, 2, 33  # an odd hidden size: bf16 rows padded to 8 bytes
    x = torch.empty((m, h), device="meta", dtype=torch.bfloat16)
    p = pack(x, torch.empty((m, k), device="meta"), torch.empty((m, k), dtype=torch.int32, device="meta"), n, 3, 2)
    assert p.per == 2 and p.send.shape == (n * 2, 8 * k + 2 * h + 6) and p.send.dtype == torch.uint8
    rows, weights, local = split_rows(p.send, k, h, torch.bfloat16)
    assert rows.shape == (n * 2, h) and rows.dtype == torch.bfloat16
    assert weights.shape == local.shape == (n * 2, k) and local.dtype == torch.int32
    assert unpack(p, torch.empty((n * 2, h), device="meta"), torch.bfloat16).shape == (2, h)


def test_pack_places_each_token_once_per_rank_holding_its_experts():
    from kvship.engine.parallel.ep_dispatch import pack, split_rows

    # 5 tokens over 2 ranks (rank 1 owns tokens 3, 4 and a padded row), 2 experts per rank
    x = torch.arange(5, dtype=torch.float32).view(5, 1).expand(5, 3).contiguous()
    ids = torch.tensor([[0, 1], [0, 2], [3, 1], [2, 3], [1, 2]])
    w = torch.full((5, 2), 0.5)
    p = pack(x, w, ids, 2, 1, 2)
    assert p.per == 3 and p.hit.tolist() == [[False, True], [True, True], [False, False]]
    # rank 0's part: token 4 (expert 1), then empty rows; rank 1's: tokens 3, 4, then an empty row
    rows, weights, local = split_rows(p.send, 2, 3, torch.float32)
    assert rows[:, 0].tolist() == [4.0, 0.0, 0.0, 3.0, 4.0, 0.0]
    assert local.tolist() == [[1, -1], [-1, -1], [-1, -1], [0, 1], [-1, 0], [-1, -1]]
    assert weights[:2].tolist() == [[0.5, 0.5], [0.0, 0.0]]


class _Recording:
    """A world-size-1 gloo communicator declaring NCCL's capture-safe ops, recording what the layer calls."""

    def __new__(cls, group):
        from kvship.engine.distributed.communicator import GlooCommunicator, NcclCommunicator

        class Recording(GlooCommunicator):
            CAPTURE_SAFE = NcclCommunicator.CAPTURE_SAFE

            def __init__(self):
                super().__init__(0, 1, device_group=group)
                self.ops = []

            def all_to_all(self, out, inp, out_splits=None, in_splits=None, async_op=False):
                self.ops.append("all_to_all" if out_splits is not None else "all_to_all_equal")
                return super().all_to_all(out, inp, out_splits, in_splits, async_op)

            def all_gather_into(self, out, t, async_op=False):
                self.ops.append("all_gather_into")
                return super().all_gather_into(out, t, async_op)

            def all_reduce(self, t, async_op=False):
                self.ops.append("all_reduce")
                return super().all_reduce(t, async_op)

        return Recording()


def test_capture_safety_and_a_capture_keeps_the_static_dispatch():
    import torch.distributed as dist

    from kvship.engine.distributed.communicator import GlooCommunicator, NcclCommunicator

    assert NcclCommunicator.capture_safe("all_to_all_equal") and not NcclCommunicator.capture_safe("all_to_all")
    assert not GlooCommunicator.capture_safe("all_to_all_equal")
    w13, w2, x, logits = _inputs(5, "random", 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        comm = _Recording(dist.group.WORLD)
        static, a2a = _layer(comm, 1, "static", False, w13, w2), _layer(comm, 1, "all_to_all", False, w13, w2)
        with torch.no_grad(), comm.graph_capture():
            got = static(x, logits)
            assert comm.ops == ["all_to_all_equal"] * 2 + ["all_gather_into"]  # rows out, partials back
            comm.ops.clear()
            a2a(x, logits)  # the host-split all_to_all cannot run in a capture: it all-reduces
            assert comm.ops == ["all_reduce"]
    finally:
        dist.destroy_process_group()
    assert (got - _want(5, "random", 1)).abs().max().item() < 1e-4


def test_startup_errors_name_the_flags(moe_path):
    from kvship.app.serve import check_tensor_parallel
    from kvship.engine.parallel.ep import apply_expert_parallel

    with pytest.raises(ValueError, match="--enable-two-batch-overlap works with --ep-dispatch all_reduce or static"):
        _sa(moe_path, 2, 2, "all_to_all", True).validate()
    with pytest.raises(ValueError, match="--ep-dispatch static needs --ep-size equal to --tp-size"):
        check_tensor_parallel(_sa(moe_path, 2, 1, "static"))
    with pytest.raises(ValueError, match="--enable-two-batch-overlap works"):
        apply_expert_parallel(torch.nn.Linear(1, 1), None, 2, "all_to_all", two_batch_overlap=True)


class _ThreadRanks:
    """The peer-memory exchange's handle for ranks that are threads of this process: each rank's buffer a CPU
    tensor every thread can read (as symmetric memory maps them) and the device barrier a thread barrier."""

    def __init__(self, n: int, capacity: int):
        import threading

        self.buffers = [torch.zeros(capacity, dtype=torch.uint8) for _ in range(n)]
        self.sync = threading.Barrier(n)
        self.barriers = 0

    def handle(self, rank: int):
        ranks = self

        class Handle:
            def get_buffer(self, r: int, sizes: tuple, dtype: torch.dtype):
                return ranks.buffers[r].view(dtype).view(sizes)

            def barrier(self, channel: int = 0):
                ranks.barriers += rank == 0
                ranks.sync.wait(timeout=30)

        return Handle()


@pytest.mark.parametrize("n", [2, 4])
def test_peer_exchange_moves_each_block_to_its_rank_and_gathers_in_rank_order(n):
    """``P2PExchange``'s pull order (``engine/parallel/p2p_exchange.py``): copy in, barrier, read each peer's block
    for this rank, barrier; against ``all_to_all_single`` / ``all_gather`` semantics, for ranks run as threads
    (the GPU test on two GPUs checks it against NCCL)."""
    import threading

    from kvship.engine.parallel.p2p_exchange import P2PExchange

    ranks = _ThreadRanks(n, 1 << 16)
    inputs = [torch.randn(n * 6, 5, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    outs, gathers, errors = [None] * n, [None] * n, []

    def rank(r: int) -> None:
        try:
            ex = P2PExchange(ranks.handle(r), ranks.buffers[r], r, n)
            outs[r] = ex.all_to_all_(torch.empty_like(inputs[r]), inputs[r])
            gathers[r] = ex.all_gather_(torch.empty((n * 3, 5)), inputs[r][:3].contiguous())
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for r in range(n):
        want = torch.cat([inputs[s][r * 6 : (r + 1) * 6] for s in range(n)])  # block r of every rank, rank order
        assert torch.equal(outs[r], want)
        assert torch.equal(gathers[r], torch.cat([inputs[s][:3] for s in range(n)]))
    assert ranks.barriers == 4  # two per exchange: before the reads, and before a buffer may be written again
    ex = P2PExchange(ranks.handle(0), ranks.buffers[0], 0, n)
    assert not ex.fits(torch.empty(4))  # CPU tensors never take it (nor tensors past the buffer, nor uneven splits)
    with pytest.raises(ValueError, match="equal splits"):
        ex.all_to_all_(torch.empty(n * 2 + 1, dtype=torch.uint8), torch.empty(n * 2 + 1, dtype=torch.uint8))


def test_peer_exchange_is_nccl_only_and_its_knob_is_checked(monkeypatch):
    from kvship.common.envs import ENV
    from kvship.engine.distributed.communicator import GlooCommunicator
    from kvship.engine.parallel.p2p_exchange import P2PExchange

    assert P2PExchange.create(None, torch.device("cpu"), 2, agree=lambda ok: ok) is None
    assert GlooCommunicator(0, 1).enable_peer_exchange(torch.device("cpu")) is False
    monkeypatch.setenv("KVSHIP_EP_EXCHANGE", "nvshmem")
    with pytest.raises(ValueError, match="nccl, p2p"):
        ENV.EP_EXCHANGE
    monkeypatch.setenv("KVSHIP_EP_EXCHANGE", " P2P ")
    assert ENV.EP_EXCHANGE == "p2p"
    monkeypatch.delenv("KVSHIP_EP_EXCHANGE")
    assert ENV.EP_EXCHANGE == "nccl"  # the default: measured no faster than NCCL (docs/parallel.md, "Dispatch")
