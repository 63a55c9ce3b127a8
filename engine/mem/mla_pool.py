"""The latent KV pool of Multi-head Latent Attention (DeepSeek; docs/deepseek.md).

``MLAKVPool`` holds, per layer, ONE latent row per KV slot: ``[num_slots +
page_size, 1, latent_dim]`` with ``latent_dim = kv_lora_rank +
qk_rope_head_dim`` (the normalised compressed KV ``c`` then the RoPE'd shared
key ``k_pe``) -- not per-head keys and values.  Slots, pages, page 0 as the
padding page, ``ReqToTokenPool`` and the radix cache work exactly as with
``KVPool`` (kvship.engine.mem.pools): only what a slot holds differs.

Memory: ``bytes_per_token = num_layers * latent_dim * element_size`` (no
factor 2: keys and values are both read from the one latent row).  For
DeepSeek-V3 (61 layers, 512 + 64, bf16) that is 70,272 bytes per token.

The pool stores the model dtype only (an FP8 latent cache is refused at
startup); ``scales`` answers 1.0 so readers written for ``KVPool`` agree.
"""

from __future__ import annotations

import torch


class MLAKVPool:
    is_fp8 = False

    def __init__(
        self,
        num_slots: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        num_layers: int,
        device: str | torch.device,
    ):
        if dtype == torch.float8_e4m3fn:
            raise ValueError("the MLA latent KV pool does not store FP8 (--kv-cache-dtype auto for MLA models)")
        self.page_size = page_size
        self.num_slots = (num_slots // page_size) * page_size
        self.dtype = dtype
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.latent_dim = kv_lora_rank + qk_rope_head_dim
        # the layout a KVPool reader sees: one "head" of latent_dim values per slot
        self.num_kv_heads = 1
        self.head_dim = self.latent_dim
        self.num_layers = num_layers
        self.device = torch.device(device)
        rows = self.num_slots + page_size
        self.kv_buffer = [
            torch.zeros((rows, 1, self.latent_dim), dtype=dtype, device=self.device) for _ in range(num_layers)
        ]

    @staticmethod
    def bytes_per_token(num_layers: int, latent_dim: int, dtype: torch.dtype) -> int:
        """KV bytes one token takes in a pool of ``num_layers`` layers (module docstring)."""
        return num_layers * latent_dim * torch.empty((), dtype=dtype).element_size()

    def get_latent_buffer(self, layer_id: int) -> torch.Tensor:
        """``[num_slots + page_size, 1, latent_dim]``: ``[..., :kv_lora_rank]`` is ``c``, the rest ``k_pe``."""
        return self.kv_buffer[layer_id]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The keys of absorbed attention: the whole latent row."""
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The values of absorbed attention: the latent's first ``kv_lora_rank`` columns (a view)."""
        return self.kv_buffer[layer_id][..., : self.kv_lora_rank]

    def scales(self, layer_id: int) -> tuple[float, float]:
        return 1.0, 1.0

    def set_latent(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor) -> None:
        """Write new latent rows ``[n, latent_dim]`` (or ``[n, 1, latent_dim]``) at slots ``loc``."""
        latent = latent.reshape(-1, 1, self.latent_dim).to(self.dtype)
        if loc.dtype != torch.int64:
            loc = loc.long()
        # index_copy_ rather than ``buf[loc] = x``: on CPU advanced-index assignment is far slower
        self.kv_buffer[layer_id].index_copy_(0, loc, latent)

    def buffers(self) -> list[torch.Tensor]:
        """Every layer's latent buffer, in layer order."""
        return list(self.kv_buffer)
