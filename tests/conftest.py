"""Shared fixtures: tiny random Hugging Face models and a test-only KV driver.

Stable public API for every test module (other helpers build on it):

Model folders (session-scoped; each a ``str`` path to a folder written by
``transformers`` ``save_pretrained`` in float32 safetensors, with
``config.json``, ``generation_config.json`` and a tokenizer saved beside it):

* ``tiny_llama_dir``      LlamaForCausalLM, untied embeddings, llama3 RoPE scaling.
* ``tiny_llama_tied_dir`` LlamaForCausalLM with tied embeddings (SmolLM2-like).
* ``tiny_qwen2_dir``      Qwen2ForCausalLM (q/k/v bias), untied.
* ``tiny_qwen3_dir``      Qwen3ForCausalLM (per-head q/k RMSNorm), untied.
* ``tiny_mistral_dir``    MistralForCausalLM (no sliding window), untied.

All share: hidden 64, intermediate 128, 2 layers, 4 heads / 2 KV heads, head
dim 16, vocab_size ``TINY_VOCAB_SIZE`` (384), max_position_embeddings 2048,
every weight random (std 0.1; biases too; norm weights around 1) so outputs
depend on every tensor.  The tokenizer is a byte-level BPE (any text,
including multi-byte UTF-8, round-trips) of about 320 tokens trained on a few
sentences, with special tokens ``<unk>`` (0), ``<s>`` (1, bos), ``</s>`` (2,
eos), ``<|im_start|>``, ``<|im_end|>`` and a ChatML ``chat_template``
(``add_generation_prompt`` supported).  The model's ``eos_token_id`` is 2
and ``bos_token_id`` 1.

* ``tiny_model_dirs``  dict ``{"llama", "llama_tied", "qwen2", "qwen3", "mistral"} -> path``.
* ``smollm2_path``     path of the embedded SmolLM2-135M-Instruct GGUF file.

Test-only driver (not product code; the real scheduler lives elsewhere):

* ``kv_driver``        factory ``kv_driver(runner) -> KVDriver``: allocates
  request rows and KV slots on a ``ModelRunner`` and runs
  ``extend`` / ``decode`` steps, plus ``greedy(prompt_ids, n)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import pytest
import torch

TINY_VOCAB_SIZE = 384
TINY_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Hello, world! This is a tiny tokenizer for tests of an LLM server.",
    "Large language models generate text one token at a time.",
    "KV caches store keys and values for every layer and position.",
    "Caffè, naïve, über, 日本語, emojis 🙂 and numbers 0123456789.",
]


def build_tiny_tokenizer():
    """A byte-level BPE ``PreTrainedTokenizerFast`` with bos/eos and a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) <= TINY_VOCAB_SIZE
    return fast


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)


def build_tiny_model(out_dir: str, arch: str, seed: int = 0, **overrides) -> str:
    """Write a tiny random model of ``arch`` (llama|qwen2|qwen3|mistral) plus tokenizer into ``out_dir``."""
    import transformers

    cfg_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[arch]
    kwargs = dict(TINY_COMMON)
    kwargs.update(overrides)
    config = cfg_cls(**kwargs)
    model_cls = {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "mistral": transformers.MistralForCausalLM,
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    _randomize(model, seed)
    if config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out_dir)
    return out_dir


_TINY_SPECS = {
    "llama": dict(
        arch="llama",
        seed=1,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_tied": dict(arch="llama", seed=2, tie_word_embeddings=True, rope_theta=100000.0),
    "qwen2": dict(arch="qwen2", seed=3, tie_word_embeddings=False),
    "qwen3": dict(arch="qwen3", seed=4, tie_word_embeddings=False),
    "mistral": dict(arch="mistral", seed=5, tie_word_embeddings=False, sliding_window=None),
}


def _tiny(tmp_path_factory: pytest.TempPathFactory, key: str) -> str:
    spec = dict(_TINY_SPECS[key])
    out = str(tmp_path_factory.mktemp(f"tiny_{key}"))
    return build_tiny_model(out, spec.pop("arch"), seed=spec.pop("seed"), **spec)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    return _tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def tiny_llama_b_dir(tmp_path_factory) -> str:
    """Another tiny llama of exactly ``tiny_llama_dir``'s shape (same KV layout), other random weights."""
    spec = dict(_TINY_SPECS["llama"])
    spec["seed"] = 101
    out = str(tmp_path_factory.mktemp("tiny_llama_b"))
    return build_tiny_model(out, spec.pop("arch"), seed=spec.pop("seed"), **spec)


@pytest.fixture(scope="session")
def tiny_llama_tied_dir(tmp_path_factory) -> str:
    return _tiny(tmp_path_factory, "llama_tied")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> str:
    return _tiny(tmp_path_factory, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> str:
    return _tiny(tmp_path_factory, "qwen3")


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory) -> str:
    return _tiny(tmp_path_factory, "mistral")


@pytest.fixture(scope="session")
def tiny_model_dirs(tiny_llama_dir, tiny_llama_tied_dir, tiny_qwen2_dir, tiny_qwen3_dir, tiny_mistral_dir) -> dict:
    return {
        "llama": tiny_llama_dir,
        "llama_tied": tiny_llama_tied_dir,
        "qwen2": tiny_qwen2_dir,
        "qwen3": tiny_qwen3_dir,
        "mistral": tiny_mistral_dir,
    }


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from kvship.engine.embedded import embedded_model_path

    try:
        path = embedded_model_path()
    except FileNotFoundError as e:
        pytest.skip(f"embedded model unavailable: {e}")
    assert os.path.isfile(path)
    return path


# --- test-only KV driver -----------------------------------------------------------
@dataclass
class DriverReq:
    row: int
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the pool
    slots: list[int] = field(default_factory=list)


class KVDriver:
    """Runs extend/decode steps on a ModelRunner the way a scheduler would (tests only)."""

    def __init__(self, runner):
        self.runner = runner

    def new(self) -> DriverReq:
        row = self.runner.req_to_token_pool.alloc()
        assert row is not None, "no free request rows"
        return DriverReq(row=row)

    def free(self, req: DriverReq) -> None:
        self.runner.allocator.free(req.slots)
        self.runner.req_to_token_pool.free(req.row)
        req.slots, req.tokens = [], []

    def _batch(self, mode, reqs: Sequence[DriverReq], new_tokens: Sequence[Sequence[int]], all_logits: bool):
        from kvship.engine.forward_batch import build_forward_batch

        r = self.runner
        prefix = [len(q.tokens) for q in reqs]
        seq = [p + len(t) for p, t in zip(prefix, new_tokens)]
        last = [q.slots[-1] if q.slots else -1 for q in reqs]
        locs = r.allocator.alloc_extend(prefix, seq, last)
        assert locs is not None, "KV pool exhausted"
        off = 0
        for q, p, toks in zip(reqs, prefix, new_tokens):
            mine = locs[off : off + len(toks)]
            off += len(toks)
            r.req_to_token_pool.write(q.row, p, mine)
            q.slots.extend(mine.tolist())
        dev = r.device
        ids = torch.tensor([t for toks in new_tokens for t in toks], dtype=torch.int64, device=dev)
        pos = torch.tensor(
            [p + i for p, toks in zip(prefix, new_tokens) for i in range(len(toks))], dtype=torch.int64, device=dev
        )
        ext = [len(t) for t in new_tokens]
        fb = build_forward_batch(
            mode,
            input_ids=ids,
            positions=pos,
            req_pool_indices=torch.tensor([q.row for q in reqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq, dtype=torch.int64, device=dev),
            seq_lens_cpu=seq,
            out_cache_loc=locs.to(dev),
            req_to_token_pool=r.req_to_token_pool,
            kv_pool=r.kv_pool,
            attn_backend=r.attn_backend,
            device=dev,
            extend_lens=ext,
            prefix_lens=prefix,
            logits_indices=torch.arange(ids.numel(), device=dev) if all_logits else None,
        )
        # a copy: under CUDA graphs the logits are a view of the graph's static output, which the next replay
        # overwrites (a caller keeping several steps' logits would otherwise see the last step's in all)
        logits = r.forward(fb).next_token_logits.clone()
        for q, toks in zip(reqs, new_tokens):
            q.tokens.extend(toks)
        return logits

    def extend(self, reqs: Sequence[DriverReq], new_tokens: Sequence[Sequence[int]], all_logits: bool = False):
        """EXTEND step; logits for every new token (``all_logits``) or the last of each request."""
        from kvship.engine.forward_batch import ForwardMode

        return self._batch(ForwardMode.EXTEND, reqs, new_tokens, all_logits)

    def decode(self, reqs: Sequence[DriverReq], tokens: Sequence[int]):
        """DECODE step: one token per request; returns ``[bs, vocab]`` logits."""
        from kvship.engine.forward_batch import ForwardMode

        return self._batch(ForwardMode.DECODE, reqs, [[t] for t in tokens], False)

    def greedy(self, prompt_ids: Sequence[int], max_new_tokens: int, eos_ids: Optional[set[int]] = None) -> list[int]:
        """Greedy continuation of one prompt (prefill then decode steps); frees its KV after."""
        req = self.new()
        out: list[int] = []
        try:
            logits = self.extend([req], [list(prompt_ids)])
            while True:
                tok = int(logits[-1].argmax())
                out.append(tok)
                if len(out) >= max_new_tokens or (eos_ids and tok in eos_ids):
                    return out
                logits = self.decode([req], [tok])
        finally:
            self.free(req)


@pytest.fixture
def kv_driver() -> Callable[[object], KVDriver]:
    return KVDriver
