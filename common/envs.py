"""Every ``KVSHIP_*`` environment knob, typed, in one place.

Read a knob as an attribute of ``ENV`` (``ENV.PDL``); each access parses the
current environment, so a component reads the knobs it needs once, when it
is built (a backend in its constructor, a layer at model load), and tests may
set a variable before building the component.  Nothing else in the project
reads ``os.environ`` for a ``KVSHIP_*`` name.  ``ENV.describe()`` lists them
(name, type, default, help) for the docs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Generic, Optional, TypeVar

T = TypeVar("T")


def _bool(raw: str) -> bool:
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0/1, got {raw!r}")


def _opt_str(raw: str) -> Optional[str]:
    return raw or None


def _opt_int(raw: str) -> Optional[int]:
    return int(raw) if raw.strip() else None


def _nonneg_int(raw: str) -> int:
    v = int(raw.strip() or "0")
    if v < 0:
        raise ValueError("expected a whole number >= 0")
    return v


def _nonneg_float(raw: str) -> float:
    v = float(raw)
    if not v >= 0:  # also refuses nan
        raise ValueError("expected a number >= 0")
    return v


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    """A parser taking one of ``choices`` (case and spaces ignored; empty: the first, the default)."""

    def parse(raw: str) -> str:
        v = raw.strip().lower() or choices[0]
        if v not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return v

    return parse


MLA_EXTEND_PATHS = ("auto", "absorbed", "decompressed")
TP_ALLREDUCE_PATHS = ("p2p", "nccl")
EP_EXCHANGE_PATHS = ("nccl", "p2p")
_mla_extend_path = _one_of(MLA_EXTEND_PATHS)
_tp_allreduce = _one_of(TP_ALLREDUCE_PATHS)
_ep_exchange = _one_of(EP_EXCHANGE_PATHS)


@dataclass(frozen=True)
class Knob(Generic[T]):
    """One environment variable: its full name, parser, default and meaning."""

    name: str
    parse: Callable[[str], T]
    default: T
    help: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None:
            return self.default
        try:
            return self.parse(raw)
        except ValueError as e:
            raise ValueError(f"{self.name}={raw!r}: {e}") from None

    def __get__(self, obj: Any, owner: Any = None) -> T:
        return self.get()


class _Env:
    """The knobs (attribute name = variable name without ``KVSHIP_``)."""

    API_KEY = Knob(
        "KVSHIP_API_KEY", _opt_str, None, "API key a worker or router requires from clients (same as --api-key)"
    )
    WORKER_API_KEY = Knob(
        "KVSHIP_WORKER_API_KEY", _opt_str, None, "API key the router sends to workers (same as --worker-api-key)"
    )
    ADMIN_API_KEY = Knob(
        "KVSHIP_ADMIN_API_KEY",
        _opt_str,
        None,
        "key of the router's admin API: POST/DELETE /workers (same as --admin-api-key; unset = admin API off)",
    )
    KV_TRANSFER_SECRET = Knob(
        "KVSHIP_KV_TRANSFER_SECRET",
        _opt_str,
        None,
        "the KV transfer secret itself (prefill and decode workers; `kvship local` hands its generated one to its "
        "children this way); --kv-transfer-secret-file wins (docs/pd.md, KV plane authentication)",
    )
    CACHE_DIR = Knob(
        "KVSHIP_CACHE_DIR", _opt_str, None, "where converted tokenizers are cached (default ~/.cache/kvship)"
    )
    FORCE_OVERLAP_SCHEDULE = Knob(
        "KVSHIP_FORCE_OVERLAP_SCHEDULE", _bool, False, "run the overlapped scheduler loop off CUDA too (tests)"
    )
    DISABLE_FUSED_OPS = Knob(
        "KVSHIP_DISABLE_FUSED_OPS",
        _bool,
        False,
        "use the torch ops instead of our Triton kernels for norms/activations",
    )
    DISABLE_SKINNY_GEMM = Knob(
        "KVSHIP_DISABLE_SKINNY_GEMM", _bool, False, "decode projections on cuBLAS instead of our Triton skinny GEMMs"
    )
    FP8_REFERENCE = Knob(
        "KVSHIP_FP8_REFERENCE",
        _bool,
        False,
        "FP8 linear layers compute with the reference arithmetic on CUDA too (A/B tests; docs/quantization.md)",
    )
    FP8_MID_MAX_M = Knob(
        "KVSHIP_FP8_MID_MAX_M",
        int,
        128,
        "FP8 linear layers: decode batches up to this many rows take the mid-size tensor-core tiles (16: off, "
        "the prefill path from 17 rows; docs/quantization.md)",
    )
    FP8_SWAP_MAX_M = Knob(
        "KVSHIP_FP8_SWAP_MAX_M",
        _nonneg_int,
        16,
        "FP8 linear layers: decode batches up to this many rows take tensor-core tiles with the weight rows as "
        "the MMA's left operand (e4m3 products); 0: none, the activation rows as the left operand, as before "
        "session 38; docs/quantization.md",
    )
    FP8_MOE_GATE_UP_MMA = Knob(
        "KVSHIP_FP8_MOE_GATE_UP_MMA",
        _nonneg_int,
        64,
        "Block-FP8 MoE decode (the GEMV path): the gate/up product on the tensor cores with this many weight rows "
        "a program (64 or 128; the weight rows as the MMA's left operand); 0: the CUDA-core GEMV of before "
        "session 38; "
        'docs/quantization.md, "MoE experts"',
    )
    PDL = Knob(
        "KVSHIP_PDL",
        _bool,
        True,
        "programmatic dependent launch for our Triton kernels (Hopper and later; 0 turns it off)",
    )
    SIDE_STREAM_TOKENS = Knob(
        "KVSHIP_SIDE_STREAM_TOKENS",
        _nonneg_int,
        16,
        "CUDA: forwards of at most this many tokens run a layer's independent branches on two streams (the shared "
        "experts beside the router and the routed experts; MLA's absorbed query beside its norm/rotary/store "
        'kernel), in CUDA graphs too; 0 turns it off; docs/deepseek.md, "Two streams"',
    )
    MLA_MERGE_UV_TOKENS = Knob(
        "KVSHIP_MLA_MERGE_UV_TOKENS",
        _nonneg_int,
        0,
        "CUDA, MLA decode steps of at most this many requests: the split-KV merge kernel also applies W_UV (one "
        "kernel for the merge and cuBLAS's batched GEMM); 0 (the default: not faster on an H200, session 38) "
        'turns it off; docs/deepseek.md, "Decode step"',
    )
    SPLIT_VERIFY = Knob(
        "KVSHIP_SPLIT_VERIFY",
        _bool,
        True,
        "speculative verify of few draft tokens on the split-KV kernel (CUDA; docs/speculative.md); for MLA "
        "models also the split-KV absorbed extend of verify rounds and short extends (docs/deepseek.md)",
    )
    FUSE_ROPE_KV_STORE = Knob(
        "KVSHIP_FUSE_ROPE_KV_STORE", _bool, True, "RoPE and the KV-cache store in one kernel on CUDA"
    )
    MOE_RUNNER = Knob(
        "KVSHIP_MOE_RUNNER",
        str,
        "auto",
        "fused-MoE runner: auto (triton on CUDA, else torch), torch or triton",
    )
    TP_ALLREDUCE = Knob(
        "KVSHIP_TP_ALLREDUCE",
        _tp_allreduce,
        "p2p",
        "tensor-parallel all-reduce: p2p (one-shot / two-shot over peer GPU memory for tensors up to the measured "
        "thresholds, NCCL above and wherever a rank cannot map peer memory) or nccl (NCCL for every size); "
        'docs/parallel.md, "The all-reduce"',
    )
    TP_ALLREDUCE_PUSH_MAX = Knob(
        "KVSHIP_TP_ALLREDUCE_PUSH_MAX",
        _nonneg_int,
        1 << 20,
        "with KVSHIP_TP_ALLREDUCE=p2p: tensors up to this many bytes (at most 1048576) take the push kernel, which "
        "writes into every peer's buffer and raises a flag there instead of meeting at a barrier (one program up to "
        "16 KiB, up to 32 chunks above; measured faster than one-shot, two-shot and NCCL from 2 KiB to 1 MiB on two "
        'H200s); 0 turns it off; docs/parallel.md, "The all-reduce"',
    )
    TP_ALLREDUCE_NORM = Knob(
        "KVSHIP_TP_ALLREDUCE_NORM",
        _bool,
        True,
        "where the push kernel takes a row-parallel layer's output, the next block's residual add and RMSNorm run "
        'in the same kernel (no norm kernel after the all-reduce); docs/parallel.md, "The all-reduce"',
    )
    TP_ALLREDUCE_SENTINEL = Knob(
        "KVSHIP_TP_ALLREDUCE_SENTINEL",
        _bool,
        True,
        "with the push kernel: tensors up to KVSHIP_TP_ALLREDUCE_SENTINEL_MAX bytes go without a flag; each rank "
        "writes its bits into its slot of every peer and spins until its own slots hold no all-ones pattern (the "
        "free mark), then frees them (8 KiB: 3.8 us against the push kernel's 5.2 on two H200s; a startup "
        'self-check against the push kernel keeps it or turns it off); 0 turns it off; docs/parallel.md, "The '
        'all-reduce"',
    )
    TP_ALLREDUCE_SENTINEL_MAX = Knob(
        "KVSHIP_TP_ALLREDUCE_SENTINEL_MAX",
        _nonneg_int,
        16 << 10,
        "with KVSHIP_TP_ALLREDUCE_SENTINEL: the largest tensor in bytes that goes without a flag (at most 1048576 "
        "and the push kernel's limit; above 16 KiB it is cut into programs as the push kernel cuts, and the "
        "all-reduce with the next RMSNorm inside takes whole batches of rows up to it; at 1 MiB no decode step "
        'measured faster, session 33); docs/parallel.md, "The all-reduce"',
    )
    EP_EXCHANGE = Knob(
        "KVSHIP_EP_EXCHANGE",
        _ep_exchange,
        "nccl",
        "the MoE static dispatch's exchange (--ep-dispatch static): nccl, or p2p (equal-split all-to-alls and "
        "all-gathers pulled over peer GPU memory, NCCL for larger tensors and wherever a rank cannot map peer "
        'memory; measured no faster than NCCL on two H200s, so off by default); docs/parallel.md, "Dispatch"',
    )
    HICACHE_LOAD_AHEAD = Knob(
        "KVSHIP_HICACHE_LOAD_AHEAD",
        _nonneg_float,
        8.0,
        "host KV tier: a waiting request whose host-tier prefix has at least this many times the tokens it still "
        "computes gets its pages loaded ahead, and joins an extend only once they are on the device, so no step "
        'waits for its copies (0: every load-back rides in the extend that admits it; docs/cache.md, "Load-ahead")',
    )
    PP_CHAIN = Knob(
        "KVSHIP_PP_CHAIN",
        _bool,
        True,
        "pipeline parallelism: stage 0 starts a decode micro-batch's next step on the last stage's sampled ids "
        "sent device to device, before the host processed them (0: after; chained only where every rank has it on; "
        'docs/parallel.md, "Pipeline parallelism")',
    )
    MLA_EXTEND = Knob(
        "KVSHIP_MLA_EXTEND",
        _mla_extend_path,
        "auto",
        "how MLA (DeepSeek) layers attend in a prefill / prefix-cached extend: auto (the cheaper path by the "
        "model's cost rule), absorbed or decompressed (benchmarks, tests; docs/deepseek.md)",
    )
    K_MAJOR_WEIGHTS = Knob("KVSHIP_K_MAJOR_WEIGHTS", _bool, False, "store Linear weights K-major for the decode GEMVs")
    FLASHINFER_CUDA_CORE_DECODE_BS = Knob(
        "KVSHIP_FLASHINFER_CUDA_CORE_DECODE_BS",
        _opt_str,
        None,
        "decode batch sizes ('lo-hi') on FlashInfer's CUDA-core decode",
    )
    FLASHINFER_NO_SPLIT_BS = Knob(
        "KVSHIP_FLASHINFER_NO_SPLIT_BS", _opt_str, None, "decode batch sizes ('lo-hi') planned without KV split"
    )
    FLASHINFER_TRITON_DECODE_BS = Knob(
        "KVSHIP_FLASHINFER_TRITON_DECODE_BS",
        _opt_str,
        None,
        "decode batch sizes ('lo-hi') of the flashinfer backend on our Triton split-KV decode",
    )
    MOONCAKE_MAX_BATCH = Knob("KVSHIP_MOONCAKE_MAX_BATCH", int, 1024, "descriptors per Mooncake batch transfer")
    NIXL_PROGRESS_THREAD = Knob("KVSHIP_NIXL_PROGRESS_THREAD", _bool, False, "NIXL's own UCX progress thread")
    ADVERTISE_HOST = Knob(
        "KVSHIP_ADVERTISE_HOST",
        _opt_str,
        None,
        "address peers reach a worker bound on 0.0.0.0 at (the operator sets the pod IP)",
    )

    # torchrun's environment (docs/parallel.md, "Launching with torchrun"): set by torchrun for each rank process;
    # read by kvship.engine.distributed.topology.  Not KVSHIP_ names: torchrun owns them.
    TORCHRUN_MASTER_ADDR = Knob("MASTER_ADDR", _opt_str, None, "torchrun: the rendezvous host (node 0)")
    TORCHRUN_MASTER_PORT = Knob("MASTER_PORT", _opt_int, None, "torchrun: the rendezvous port")
    TORCHRUN_WORLD_SIZE = Knob("WORLD_SIZE", _opt_int, None, "torchrun: rank processes of the whole job")
    TORCHRUN_RANK = Knob("RANK", _opt_int, None, "torchrun: this process's global rank")
    TORCHRUN_LOCAL_RANK = Knob("LOCAL_RANK", _opt_int, None, "torchrun: this process's index on its node")
    TORCHRUN_LOCAL_WORLD_SIZE = Knob(
        "LOCAL_WORLD_SIZE", _opt_int, None, "torchrun: rank processes per node (default WORLD_SIZE / --nnodes)"
    )

    @classmethod
    def knobs(cls) -> list[Knob]:
        return [v for v in vars(cls).values() if isinstance(v, Knob)]

    @classmethod
    def describe(cls) -> list[tuple[str, str, Any, str]]:
        return [(k.name, getattr(k.parse, "__name__", "str").lstrip("_"), k.default, k.help) for k in cls.knobs()]


ENV = _Env()
