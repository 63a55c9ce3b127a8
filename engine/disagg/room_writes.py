"""What a prefill transfer thread writes for one room (``sender.PrefillKVManager`` runs it).

* ``whole``: once the prompt is computed and its first token sampled, a decode
  rank's KV heads of every page (and the per-slot features, when they travel to
  it) in one batch, then the aux record, then the done signal (docs/pd.md, "How
  a request's KV travels").
* ``layerwise``: from the start of the forward in which the prompt's last
  chunk computes (docs/pd.md, "Layer-wise transfer"): the pages complete
  before that forward, every layer, to each decode rank; then, for each run of
  layers the forward has stored (``LayerProgress.wait``), the other pages of
  those layers; once the first token is there, the features, the aux record
  and the done signal, rank by rank.

Rooms travel as ``auth.RoomKey``: the backend marks its writes with the
room's tags where it can (tcp frames) and the aux record carries the room's
aux tag (docs/pd.md, "KV plane authentication").  Descriptors are checked
against both sides' registered regions before a write.  ``cancelled()`` is looked at between writes: once it is true the
room's failure is decided elsewhere and nothing more is written.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np
import torch

from kvship.engine.disagg import descriptors as D
from kvship.engine.disagg.auth import RoomKey
from kvship.engine.disagg.base import AuxInfo, KVTransferError, TransferBackend, TransferDescs
from kvship.engine.disagg.checksum import kv_checksum_heads
from kvship.engine.disagg.layerwise import LayerProgress
from kvship.engine.disagg.tp_slices import head_slice, layer_buffers, map_layers, shared_layers, slice_kv_descs
from kvship.engine.disagg.wire import AUX_RECORD_BYTES, AuxRecord, Done, KVLayout, Register, Started

if TYPE_CHECKING:
    from kvship.engine.disagg.prefill_room import DecodePeer

logger = logging.getLogger(__name__)


class RoomWriter:
    """The write sequences of one prefill rank's rooms (see the module docstring).

    ``regions``' sizes are the local registered regions (K/V buffers in ``KVPool.buffers()`` order, the
    features buffer when ``feature_region`` is not None, the aux staging buffer at ``aux_region``);
    ``aux_staging`` has one ``AUX_RECORD_BYTES`` row per transfer thread (``index``).
    """

    def __init__(
        self,
        layout: KVLayout,
        backend: TransferBackend,
        buffers: Sequence[torch.Tensor],
        region_sizes: Sequence[int],
        feature_region: Optional[int],
        aux_region: int,
        aux_staging: torch.Tensor,
        layerwise_writes: int = 0,
    ):
        self.layout = layout
        # a layer-wise send writes groups of this many layers (the last may be shorter); 1: each stored layer
        n = layout.num_layers
        self.layer_group = -(-n // layerwise_writes) if 0 < layerwise_writes < n else 1
        self.backend = backend
        self.buffers = list(buffers)
        self.region_sizes = list(region_sizes)
        self.feature_region = feature_region
        self.aux_region = aux_region
        self.aux_staging = aux_staging

    @staticmethod
    def guard(room: int, peer: "DecodePeer", fn: Callable[..., None], *args) -> Optional[str]:
        """Run one step of a transfer to ``peer``; its failure as the room's reason (None: it went well)."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - every failure fails the room cleanly
            if not isinstance(e, KVTransferError):
                logger.exception("KV transfer for room %d failed", room)
            return f"transfer to decode {peer.peer_id} failed: {e}"
        return None

    # -- the two sequences -------------------------------------------------------------
    def whole(
        self,
        index: int,
        key: RoomKey,
        stamps: dict,
        peer: "DecodePeer",
        reg: Register,
        src_pages: np.ndarray,
        aux: AuxInfo,
        cancelled: Callable[[], bool],
    ) -> None:
        """The whole room to one decode rank; raises on failure."""
        layout, room = self.layout, key.room
        stamps["transfer_start"] = time.time()
        dst = peer.hello.layout  # this decode rank gets its KV heads (tp_slices.head_slice), the aux record, done
        peer.conn.send(Started(room=room))
        part = head_slice(layout.model_kv_heads, layout.tp_size, layout.tp_rank, dst.tp_size, dst.tp_rank)
        shared = shared_layers(layout, dst)  # the layers both ranks hold (pipeline stages)
        checksum = None
        if reg.checksum is not None:
            checksum = 0
            if part is not None and shared is not None:
                bufs = layer_buffers(self.buffers, layout, *shared)
                checksum = kv_checksum_heads(
                    bufs, src_pages, layout.page_size, part.src_head, part.num_heads, reg.checksum
                )
        parts = [
            d
            for d in (self.kv_descs(peer, src_pages, reg.pages), self.feature_descs(peer, src_pages, reg.pages))
            if d is not None
        ]
        if parts:
            descs = D.concat_descs(parts)
            D.check_descs(descs, self.region_sizes, peer.region_bytes)
            if cancelled():
                return
            self.backend.write(peer.peer_id, key, descs)
        if cancelled():
            return
        self.finish_peer(index, key, peer, reg, src_pages, aux, checksum)
        stamps["transfer_end"] = time.time()

    def layerwise(
        self,
        index: int,
        key: RoomKey,
        stamps: dict,
        targets: list[tuple["DecodePeer", Register]],
        pages: np.ndarray,
        ready: int,
        progress: LayerProgress,
        cancelled: Callable[[], bool],
        first_token: Callable[[], Optional[tuple[np.ndarray, AuxInfo]]],
    ) -> Optional[str]:
        """A layer-wise room to every decode rank in ``targets``; ``first_token()`` blocks until the pages and aux
        record of ``send()`` are there (None: the room failed meanwhile).  Returns the failure reason, or None
        when it went well or was cancelled."""
        stamps["transfer_start"] = time.time()
        num_layers, room = self.layout.num_layers, key.room
        plans = []
        for peer, reg in targets:
            peer.conn.send(Started(room=room))
            before = self.kv_descs(peer, pages[:ready], reg.pages[:ready])
            error = self.guard(room, peer, self.write, key, peer, before)
            if error is not None or cancelled():
                return error
            plans.append((peer, self.kv_descs(peer, pages[ready:], reg.pages[ready:])))
        written = 0
        while written < num_layers:
            # wait for a whole group: each write is a transfer call on this thread, and fewer of them during
            # the forward leave its thread the interpreter more often (docs/pd.md, "Layer-wise transfer")
            end = progress.wait(min(written + self.layer_group, num_layers) - 1, cancelled)
            if cancelled():
                return None
            if end == 0:
                return f"the prefill forward failed before layer {written} was stored"
            now = time.time()
            stamps.setdefault("layers_first", now)
            stamps["layers_last"] = now
            for peer, descs in plans:
                planes = self.layout.kv_planes
                part = None if descs is None else D.select_layers(descs, num_layers, written, end, planes)
                error = self.guard(room, peer, self.write, key, peer, part)
                if error is not None:
                    return error
            written = end
        sent = first_token()
        if sent is None:
            return None
        src_pages, aux = sent
        stamps["tail_start"] = time.time()
        for peer, reg in targets:
            if cancelled():
                return None
            features = self.feature_descs(peer, src_pages, reg.pages)
            error = self.guard(room, peer, self.write, key, peer, features) or self.guard(
                room, peer, self.finish_peer, index, key, peer, reg, src_pages, aux, None
            )
            if error is not None:
                return error
        stamps["transfer_end"] = time.time()
        return None

    # -- the parts -----------------------------------------------------------------------
    def kv_descs(self, peer: "DecodePeer", src_pages: np.ndarray, dst_pages: np.ndarray) -> Optional[TransferDescs]:
        """The K/V bytes of these pages this rank writes into decode rank ``peer`` (its KV heads,
        ``tp_slices.head_slice``) of the layers both hold (``tp_slices.map_layers``), or None when it holds none
        of them."""
        layout, dst = self.layout, peer.hello.layout
        part = head_slice(layout.model_kv_heads, layout.tp_size, layout.tp_rank, dst.tp_size, dst.tp_rank)
        if part is None or src_pages.size == 0:
            return None
        runs = D.page_runs(src_pages, dst_pages)
        descs = slice_kv_descs(
            runs, layout.num_buffers, layout.page_size, layout.head_bytes, layout.num_kv_heads, dst.num_kv_heads, part
        )
        return map_layers(descs, layout, dst)  # the layers both hold, into decode's buffers of those layers

    def feature_descs(
        self, peer: "DecodePeer", src_pages: np.ndarray, dst_pages: np.ndarray
    ) -> Optional[TransferDescs]:
        """The per-slot features of these pages for decode rank ``peer``, or None (none travel to it from this
        rank: replicated over TP, so one rank of the last pipeline stage, which computes them, sends them)."""
        dst, lay = peer.hello.layout, self.layout
        if self.feature_region is None or not peer.features or dst.tp_rank % lay.tp_size != lay.tp_rank:
            return None
        if lay.layer_end != lay.all_layers:
            return None
        runs = D.page_runs(src_pages, dst_pages)
        return D.region_descs(runs, self.feature_region, dst.num_buffers, self.layout.feature_page_bytes)

    def write(self, key: RoomKey, peer: "DecodePeer", descs: Optional[TransferDescs]) -> None:
        if descs is None or not len(descs):
            return
        D.check_descs(descs, self.region_sizes, peer.region_bytes)
        self.backend.write(peer.peer_id, key, descs)

    def finish_peer(
        self,
        index: int,
        key: RoomKey,
        peer: "DecodePeer",
        reg: Register,
        src_pages: np.ndarray,
        aux: AuxInfo,
        checksum: Optional[int],
    ) -> None:
        """The aux record, then the done signal (in band, or on the control plane), or both in one message
        where the backend and the peer can (``TransferBackend.send_aux_done``)."""
        room = key.room
        record = AuxRecord(
            room=room,
            first_token_id=int(aux.first_token_id),
            first_token_logprob=float(aux.first_token_logprob),
            prompt_len=int(aux.prompt_len),
            num_pages=int(src_pages.size),
            checksum=checksum,
            top_logprobs=tuple(aux.first_token_top_logprobs),
            tag=key.aux_tag,
        )
        packed = record.pack()
        if self.backend.peer_takes_aux_in_done(peer.peer_id):
            # one message after the KV: the record and the done signal (docs/pd.md, "How a request's KV travels")
            self.backend.send_aux_done(peer.peer_id, key, reg.aux_slot, packed)
            return
        self.aux_staging[index].copy_(torch.frombuffer(bytearray(packed), dtype=torch.uint8))
        in_band = self.backend.in_band_done
        self.backend.write(
            peer.peer_id,
            key,
            D.aux_descs(self.aux_region, index, len(peer.region_bytes) - 1, reg.aux_slot, AUX_RECORD_BYTES),
            done=in_band,
        )
        if not in_band and not peer.conn.send(Done(room=room)):
            raise KVTransferError(f"decode connection lost before the done signal: {peer.conn.close_reason}")
