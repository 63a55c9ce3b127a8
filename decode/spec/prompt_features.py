"""``PromptFeatures``: a prefill worker's share of EAGLE drafting (docs/speculative.md, "PD").

A decode worker's ``EagleDrafter`` drafts from one feature per target KV slot
(``EagleHead.project`` of the target's hidden states).  In PD the prompt's
slots are computed by the prefill worker, so a prefill worker started with
``--speculative-algorithm eagle|eagle3 --speculative-draft-model-path HEAD``
keeps the same per-slot features of every forward it runs, and the KV
transfer layer ships them with the prompt's K/V pages (``SlotFeatures``,
registered as one more per-slot buffer).  It loads only the projection
(``eagle_head.FeatureProjection``: nothing for EAGLE, ``fc`` for EAGLE-3) and
never drafts.

Contract: one ``PromptFeatures`` per prefill model runner, built before the
scheduler (its ``slot_features`` go to the transfer layer); it owns the
runner's ``hidden_capture``.  A feature depends on the token prefix exactly
like its slot's K/V, so prefix-cache hits on prefill ship cached features
too, and freed slots need no cleanup.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvship.decode.spec.eagle_head import build_projection, feature_kind
from kvship.engine.disagg.base import SlotFeatures
from kvship.engine.forward_batch import HiddenCapture

logger = logging.getLogger(__name__)


class PromptFeatures:
    def __init__(self, server_args: Any, target_runner: Any):
        variant = server_args.speculative_algorithm
        if variant not in ("eagle", "eagle3"):
            raise ValueError(f"--speculative-algorithm {variant}: prompt features exist for eagle and eagle3 only")
        r = target_runner
        if r.hidden_capture is not None:
            raise ValueError("the prefill model runner already captures hidden states")
        path = server_args.speculative_draft_model_path
        self.projection = build_projection(path, variant, r.model_config, r.device)
        cfg = self.projection.cfg
        self.features = torch.zeros(
            (r.kv_pool.num_slots + r.page_size, cfg.model.hidden_size), dtype=r.dtype, device=r.device
        )
        self.kind = feature_kind(cfg, self.projection.fc if self.projection.eagle3 else None)
        r.hidden_capture = HiddenCapture(layers=cfg.aux_layer_ids, sink=self._store)
        logger.info(
            "prefill computes %s features for decode's drafter (%s, %s): %d per KV slot",
            variant,
            path,
            self.kind,
            cfg.model.hidden_size,
        )

    @property
    def slot_features(self) -> SlotFeatures:
        return SlotFeatures(self.kind, self.features)

    def _store(self, out_cache_loc: torch.Tensor, hidden: torch.Tensor) -> None:
        with torch.inference_mode():
            self.features[out_cache_loc] = self.projection(hidden).to(self.features.dtype)
