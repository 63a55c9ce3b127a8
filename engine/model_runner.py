"""The model runner: weights, KV memory and the attention backend of one worker.

``ModelRunner(server_args)``:
1. resolves the model path (``None`` -> the embedded SmolLM2 GGUF), device
   and dtype, and reads ``ModelConfig``;
2. builds the model and loads its weights (``--load-format``);
3. sizes the KV pool: on CUDA from ``--mem-fraction-static`` (weights + KV
   may use that fraction of the GPU: KV gets the free memory after loading
   minus the ``1 - fraction`` reserve, and without ``--max-total-tokens`` at
   most ``CUDA_MAX_CONTEXTS_PER_ROW`` full contexts per request row), on CPU
   from ``--max-total-tokens`` (default: what fits in 2 GiB, at most 65536
   tokens); ``--max-total-tokens`` also caps the CUDA size;
4. creates ``req_to_token_pool``, ``kv_pool`` and ``allocator``, then the
   ``attn_context`` (``AttentionContext``: all an attention backend learns of
   this runner) and from it ``attn_backend`` and, on CUDA, the decode
   ``cuda_graph_runner`` (capturing ``attn_context.cuda_graph_bs``).
   An MLA model (DeepSeek; docs/deepseek.md) gets the latent pool
   (``MLAKVPool``: one latent row per token and layer, sized by it) and an
   MLA backend instead, after ``check_mla_serving`` refused the modes it
   does not run in.

Public attributes the scheduler relies on (keep the names): ``device``,
``dtype``, ``model_config``, ``req_to_token_pool``, ``kv_pool``,
``allocator``, ``attn_backend``, ``context_len``, ``max_total_tokens``
(= ``allocator.total_slots``), ``page_size``, ``max_running_requests``.

``forward(forward_batch) -> LogitsOutput``: builds the backend's per-step
metadata, then runs the model under ``torch.inference_mode``.  Sampling is
not done here (``kvship.engine.sampler``).  With ``hidden_capture`` set (an
EAGLE speculator, docs/speculative.md) every eager forward also hands the new
tokens' hidden states to its sink.

Pipeline parallelism (``--pp-size`` > 1; docs/parallel.md): the runner
builds and loads only its stage's layers (``stage_layers``; the embedding on
the first stage, final norm and LM head on the last), its KV pool holds only
those layers, and ``pipeline`` is its ``StageLink``.  ``forward`` then
receives the previous stage's hidden states and residual first (not on the
first stage), runs its layers (a CUDA graph for decode batches, the receive
and send outside it), and either sends its output on and returns it as a
``StageOutput`` or, on the last stage, returns the logits.
"""

from __future__ import annotations

import contextlib
import logging
from typing import ContextManager, Optional

import torch

from kvship.common.envs import ENV
from kvship.engine.attention.base import AttentionContext, create_attention_backend
from kvship.engine.attention.mla_registry import create_mla_attention_backend
from kvship.engine.config import ServerArgs
from kvship.engine.cuda_graph_runner import cuda_graph_batch_sizes, maybe_create_cuda_graph_runner
from kvship.engine.distributed.groups import ProcessGroups
from kvship.engine.distributed.pipeline import StageLink, stage_layers
from kvship.engine.forward_batch import ForwardBatch, HiddenCapture, LogitsOutput, StageOutput
from kvship.engine.layers.fused_dispatch import cuda_fp8_kernels
from kvship.engine.layers.k_major import store_weights_k_major_
from kvship.engine.layers.moe.layer import reset_expert_load
from kvship.engine.loaders.base import load_model
from kvship.engine.mem.kv_scales import read_kv_scales, read_latent_scales
from kvship.engine.mem.mla_pool import MLAKVPool
from kvship.engine.mem.pools import KVPool, ReqToTokenPool, TokenToKVPoolAllocator, is_fp8_kv, kv_cache_torch_dtype
from kvship.engine.model_config import ModelConfig, parse_dtype
from kvship.engine.parallel.layers import head_split
from kvship.engine.prefill_graph_runner import maybe_create_prefill_graph_runner

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 2 * 1024**3
CPU_MAX_DEFAULT_TOKENS = 65536
# extra ReqToTokenPool rows beyond --max-running-requests (chunked prefills, requests being finished)
REQ_POOL_HEADROOM = 16
# CUDA sizing never goes past this many full contexts per request row: beyond it the
# memory only lengthens prefix-cache retention, and tiny models would take the whole GPU
CUDA_MAX_CONTEXTS_PER_ROW = 4


def resolve_model_path(model_path: Optional[str]) -> str:
    if model_path is None:
        from kvship.engine.embedded import embedded_model_path

        return embedded_model_path()
    return model_path


class ModelRunner:
    def __init__(self, server_args: ServerArgs, groups: Optional[ProcessGroups] = None):
        server_args.validate()
        self.server_args = server_args
        # a multi-rank worker: this rank's communicators (kvship.engine.distributed); None at one rank (no
        # collective at all).  ``tp`` is the TP communicator the parallel layers and the transfer layer use.
        self.groups = groups
        tp = self.tp = None if groups is None else groups.tp
        self.tp_size = 1 if tp is None else tp.size
        self.tp_rank = 0 if tp is None else tp.rank
        if server_args.num_threads is not None:
            torch.set_num_threads(server_args.num_threads)
        self.device = torch.device(server_args.resolved_device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--device cuda was requested but CUDA is not available")
        if self.device.type == "cuda":
            # the rank of local index l on its node: cuda:<base-gpu-id + l>
            gpu = server_args.base_gpu_id if groups is None else groups.topology.gpu_id
            index = gpu if self.device.index is None else self.device.index
            torch.cuda.set_device(index)
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = parse_dtype(server_args.resolved_dtype)
        self.kv_dtype = kv_cache_torch_dtype(server_args.resolved_kv_dtype)
        self.page_size = server_args.page_size
        self.max_running_requests = server_args.max_running_requests

        self.model_path = resolve_model_path(server_args.model_path)
        self.model_config = ModelConfig.from_pretrained(
            self.model_path,
            dtype=self.dtype,
            context_length=server_args.context_length,
            quantization=server_args.quantization,
        )
        self.context_len = self.model_config.context_len

        mc = self.model_config
        if mc.mla is not None:  # DeepSeek: the modes MLA does not run in yet are refused here, by name
            from kvship.engine.models.deepseek import check_mla_serving

            check_mla_serving(server_args)
        # pipeline parallelism: this rank's stage holds only its layers (None: the whole model)
        self.pipeline: Optional[StageLink] = None
        layers = None
        if groups is not None and groups.topology.pp_size > 1:
            ranges = stage_layers(
                mc.num_hidden_layers, groups.topology.pp_size, server_args.resolved_pp_layer_partition
            )
            self.pipeline = StageLink(groups, ranges)
            layers = self.pipeline.layers
        self.num_layers = mc.num_hidden_layers if layers is None else len(layers)  # layers in this KV pool
        # this rank's attention heads (all of them at --tp-size 1)
        split = head_split(mc.num_attention_heads, mc.num_key_value_heads, self.tp_size, self.tp_rank)
        self.num_heads, self.num_kv_heads = split.num_heads, split.num_kv_heads
        # MoE at --tp-size > 1: each rank holds its share of the experts (--ep-size; docs/parallel.md)
        ep = (
            server_args.ep_size,
            server_args.ep_dispatch,
            server_args.ep_num_redundant_experts,
            server_args.enable_two_batch_overlap,
        )
        self.model = load_model(
            mc, server_args.load_format, self.device, seed=server_args.seed, tp=tp, ep=ep, layers=layers
        )
        # EPLB (docs/parallel.md, "Expert load balancing"): rebalances between forwards, on every rank alike
        self.eplb = None
        if server_args.ep_num_redundant_experts and tp is not None and mc.moe is not None:
            from kvship.engine.parallel.eplb import EPLBManager

            self.eplb = EPLBManager(self.model, tp, server_args.eplb_rebalance_interval)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if self.device.type == "cuda" and ENV.K_MAJOR_WEIGHTS:  # opt-in, see the function
            logger.info("K-major weights: %d matrices re-stored", store_weights_k_major_(self.model))

        num_slots = self._kv_pool_slots()
        if groups is not None:  # every rank schedules the same slots: the smallest pool of any rank
            num_slots = groups.world.min_int(num_slots)
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests + REQ_POOL_HEADROOM, self.context_len + self.page_size, self.device
        )
        mc = self.model_config
        # FP8 KV: the checkpoint's per-layer k/v scales, else 1.0 (docs/quantization.md, "FP8 KV cache")
        fp8_kv = is_fp8_kv(self.kv_dtype) and server_args.load_format != "dummy"  # dummy weights: scales 1.0
        if mc.mla is not None:  # one latent row per token and layer, one FP8 scale per layer (docs/deepseek.md)
            from kvship.engine.models.deepseek_mtp import mtp_layers

            # the checkpoint's MTP layers (stored after the model's) may carry scales of their own: allowed here
            latent = (
                read_latent_scales(self.model_path, mc.num_hidden_layers, mtp_layers(self.model_path))
                if fp8_kv
                else None
            )
            if latent is not None:  # the model's layers (a pipeline stage's only), not the MTP layers'
                latent = latent[: mc.num_hidden_layers] if layers is None else latent[layers.start : layers.end]
            self.kv_pool = MLAKVPool(
                num_slots,
                self.page_size,
                self.kv_dtype,
                mc.mla.kv_lora_rank,
                mc.mla.qk_rope_head_dim,
                self.num_layers,
                self.device,
                latent,
            )
        else:
            scales = read_kv_scales(self.model_path, mc.num_hidden_layers) if fp8_kv else None
            if scales is not None and layers is not None:  # a pipeline stage's pool holds its layers only
                scales = (scales[0][layers.start : layers.end], scales[1][layers.start : layers.end])
            self.kv_pool = KVPool(
                num_slots,
                self.page_size,
                self.kv_dtype,
                self.num_kv_heads,
                mc.head_dim,
                self.num_layers,
                self.device,
                *(scales or (None, None)),
            )
        self.allocator = TokenToKVPoolAllocator(self.kv_pool.num_slots, self.page_size)
        self.attn_context = AttentionContext(
            device=self.device,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            num_heads=self.num_heads,
            # MLA: absorbed attention is MQA over the latent row
            num_kv_heads=1 if mc.mla is not None else self.num_kv_heads,
            head_dim=mc.mla.latent_dim if mc.mla is not None else mc.head_dim,
            page_size=self.page_size,
            req_to_token_pool=self.req_to_token_pool,
            max_running_requests=self.max_running_requests,
            cuda_graph_bs=tuple(cuda_graph_batch_sizes(server_args, self.max_running_requests)),
        )
        if mc.mla is not None:
            self.attn_backend = create_mla_attention_backend(server_args.attention_backend, self.attn_context)
        else:
            backend = server_args.resolved_attention_backend(mc.head_dim)
            if server_args.attention_backend == "auto":
                logger.info("attention backend: %s (auto, head_dim %d)", backend, mc.head_dim)
            self.attn_backend = create_attention_backend(backend, self.attn_context)
        # set by an EAGLE speculator: eager forwards hand it the tokens' hidden states (docs/speculative.md)
        self.hidden_capture: Optional[HiddenCapture] = None
        self._probe_fp8_products()  # before any capture: the FP8 GEMM path is then the same eager and replayed
        # CUDA-graph decode (None on CPU, with --disable-cuda-graph, or for backends without graphs)
        with self.graph_capture():  # the graph runners capture in their constructors
            self.cuda_graph_runner = maybe_create_cuda_graph_runner(
                self.model,
                self.attn_backend,
                self.attn_context,
                self.kv_pool,
                server_args.disable_cuda_graph,
                # a later pipeline stage's graphs read the received residual stream from a static buffer
                stage_input_width=None if self.pipeline is None or self.pipeline.is_first else mc.hidden_size,
            )
        # piecewise CUDA graphs for short prefills (None on CPU, with --disable-cuda-graph or
        # --prefill-graph-max-tokens 0); they share the decode graphs' memory pool
        with self.graph_capture():
            self.prefill_graph_runner = maybe_create_prefill_graph_runner(
                self.model,
                self.attn_backend,
                self.req_to_token_pool,
                self.kv_pool,
                self.device,
                # decode: rare resumes; a pipeline stage: prefill runs eagerly (docs/parallel.md)
                0 if server_args.mode == "decode" or self.pipeline else server_args.prefill_graph_max_tokens,
                # MLA: its backends capture decode graphs only (docs/deepseek.md)
                server_args.disable_cuda_graph or mc.mla is not None,
                ep_all_to_all=server_args.ep_size > 1 and server_args.ep_dispatch == "all_to_all",
                pool=None if self.cuda_graph_runner is None else self.cuda_graph_runner.pool,
            )
        reset_expert_load(self.model)  # MoE: the expert-load counters start after warm-up and capture
        logger.info(
            "model %s: %d layers, context %d, weights %.1f MiB; KV pool %d tokens (%s, page %d) on %s%s",
            mc.architecture,
            mc.num_hidden_layers,
            self.context_len,
            self.weight_bytes / 2**20,
            self.max_total_tokens,
            str(self.kv_dtype).removeprefix("torch."),
            self.page_size,
            self.device,
            "" if tp is None else f", tensor-parallel rank {tp.rank}/{tp.size}",
        )
        if self.pipeline is not None:
            logger.info("%s", self.pipeline.describe())

    def _probe_fp8_products(self) -> None:
        """A model with FP8 weights on CUDA: which block-128 GEMM its larger batches take (cuBLAS where this
        torch computes it right, else the Triton GEMM), decided once per device before graphs are captured."""
        if self.device.type != "cuda":
            return
        param = next((p for p in self.model.parameters() if p.dtype == torch.float8_e4m3fn), None)
        kernels = None if param is None else cuda_fp8_kernels(param)
        if kernels is not None:
            kernels.probe_block_scaled_mm(torch.device(self.device))

    def graph_capture(self) -> ContextManager[None]:
        """Open around every CUDA-graph capture of this runner's model (decode, prefill, speculative graphs):
        the communicators answer ``can_run`` for a capture (kvship.engine.distributed.communicator)."""
        return contextlib.nullcontext() if self.groups is None else self.groups.graph_capture()

    # --- sizing ------------------------------------------------------------
    @property
    def max_total_tokens(self) -> int:
        return self.allocator.total_slots

    def _bytes_per_token(self) -> int:
        mc = self.model_config
        if mc.mla is not None:  # one latent row, not K and V per head
            return MLAKVPool.bytes_per_token(self.num_layers, mc.mla.latent_dim, self.kv_dtype)
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * mc.head_dim * elem

    def _kv_pool_slots(self) -> int:
        """Slots for the KV pool, a whole number of pages, at least one page."""
        sa = self.server_args
        per_token = self._bytes_per_token()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free) - int(total) * (1.0 - sa.mem_fraction_static)
            tokens = int(budget // per_token)
            if tokens < self.page_size:
                raise RuntimeError(
                    f"no GPU memory left for the KV cache: {free / 2**30:.2f} GiB free after loading weights, "
                    f"{(1 - sa.mem_fraction_static) * total / 2**30:.2f} GiB reserved; raise --mem-fraction-static"
                )
            if sa.max_total_tokens is not None:
                tokens = min(tokens, sa.max_total_tokens)
            else:
                rows = self.max_running_requests + REQ_POOL_HEADROOM
                tokens = min(tokens, CUDA_MAX_CONTEXTS_PER_ROW * rows * self.context_len)
        elif sa.max_total_tokens is not None:
            tokens = sa.max_total_tokens
        else:
            tokens = min(CPU_MAX_DEFAULT_TOKENS, CPU_KV_BUDGET_BYTES // per_token)
        tokens = (tokens // self.page_size) * self.page_size
        if tokens < self.page_size:
            raise ValueError(f"KV pool of {tokens} tokens holds no page of {self.page_size}")
        return tokens

    # --- compute -----------------------------------------------------------
    def forward(self, forward_batch: ForwardBatch) -> LogitsOutput:
        """Logits (float32) for ``forward_batch.logits_indices`` (default: last new token per request).

        The caller must have written every position's slot into
        ``req_to_token`` (see ``kvship.engine.forward_batch``).
        """
        if self.eplb is not None:  # between steps: maybe move experts and switch the routing tables
            self.eplb.step()
        if self.pipeline is not None:
            with torch.inference_mode():
                return self._forward_stage(forward_batch)
        with torch.inference_mode():
            if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch):
                return self.cuda_graph_runner.replay(forward_batch)
            self.attn_backend.init_forward_metadata(forward_batch)
            hc = self.hidden_capture
            if hc is None:
                pg = self.prefill_graph_runner
                if pg is not None and pg.can_run(forward_batch):
                    return pg.replay(forward_batch)
                return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
            forward_batch.capture_hidden = hc.layers
            out = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
            hc.sink(forward_batch.out_cache_loc, out.hidden_states)
            return out

    def _forward_stage(self, fb: ForwardBatch) -> LogitsOutput | StageOutput:
        """One pipeline stage's part of ``fb`` (module docstring): a ``StageOutput`` (already on its way to the
        next stage) or, on the last stage, the logits."""
        link = self.pipeline
        assert link is not None
        stage_input = None
        if not link.is_first:
            buf = link.recv_hidden(int(fb.input_ids.shape[0]), self.model_config.hidden_size, self.dtype, self.device)
            stage_input = (buf[0], buf[1])
        graphs = self.cuda_graph_runner
        if graphs is not None and graphs.can_run(fb):
            out = graphs.replay(fb, stage_input)
        else:
            self.attn_backend.init_forward_metadata(fb)
            out = self.model(fb.input_ids, fb.positions, fb, stage_input=stage_input)
        if isinstance(out, StageOutput):
            link.send_hidden(out.hidden, out.residual)
        return out
