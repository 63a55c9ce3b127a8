"""The tokenizer front: load a Hugging Face tokenizer, encode prompts, render chat templates.

``load_tokenizer(path)`` accepts a Hugging Face folder or a ``.gguf`` file
(whose ``tokenizer.*`` metadata holds the vocabulary, merges and chat
template; transformers converts it with ``gguf_file=``).  Converting a GGUF
tokenizer takes several seconds, so the converted tokenizer is cached on disk
(``$KVSHIP_CACHE_DIR`` or ``~/.cache/kvship``), keyed by the file's path,
size and mtime; a cache that cannot be written is skipped silently.

``Tokenizer`` is a thin wrapper with the calls the server needs.  Its
contract: ``encode`` never adds special tokens to a chat-rendered prompt
twice (chat prompts are rendered to text by the template, which already holds
BOS where the model wants it), ``apply_chat_template`` renders in a bounded
sandbox (``kvship.engine.chat_template``: output and time limits) and raises
``ChatTemplateError`` (a ValueError with a user-facing message) for anything
a client can get wrong, and ``token_bytes`` gives the exact bytes a token
stands for (byte-level BPE, SentencePiece byte fallback and plain pieces).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from functools import lru_cache
from typing import Any, Optional, Sequence

from kvship.common.envs import ENV
from kvship.engine.chat_template import ChatTemplateError, RenderLimits, render

__all__ = ["ChatTemplateError", "RenderLimits", "Tokenizer", "load_tokenizer"]

logger = logging.getLogger(__name__)

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _gguf_cache_dir(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = hashlib.sha256(f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    root = ENV.CACHE_DIR or os.path.join(os.path.expanduser("~"), ".cache", "kvship")
    return os.path.join(root, "gguf-tokenizers", key)


def _load_hf_tokenizer(path: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    if os.path.isfile(path) and path.endswith(".gguf"):
        cache = _gguf_cache_dir(path)
        if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
            try:
                return AutoTokenizer.from_pretrained(cache)
            except Exception as e:  # a damaged cache: rebuild it
                logger.warning("ignoring tokenizer cache %s: %s", cache, e)
        logger.info("converting the GGUF tokenizer of %s (cached afterwards)", path)
        tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
        _write_cache(tok, cache)
        return tok
    if os.path.isdir(path):
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    raise FileNotFoundError(f"tokenizer path '{path}' is neither a folder nor a .gguf file")


def _write_cache(tok: Any, cache: str) -> None:
    """Save a converted tokenizer atomically (a racing process may win; that is fine)."""
    tmp = f"{cache}.tmp{os.getpid()}"
    try:
        tok.save_pretrained(tmp)
        if not os.path.exists(cache):
            os.replace(tmp, cache)
    except OSError as e:
        logger.debug("tokenizer cache not written: %s", e)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(path: str, trust_remote_code: bool = False) -> "Tokenizer":
    """Load the tokenizer of a Hugging Face folder or a GGUF file."""
    return Tokenizer(_load_hf_tokenizer(path, trust_remote_code))


def _message_text(content: Any, index: int) -> str:
    """OpenAI message content (a string or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatTemplateError(f"messages[{index}].content: only text parts are supported, got '{kind}'")
            parts.append(part["text"])
        return "".join(parts)
    raise ChatTemplateError(f"messages[{index}].content must be a string or a list of text parts")


class Tokenizer:
    """What the server needs from a Hugging Face tokenizer (``hf`` is the wrapped object)."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        self._max_piece: Optional[int] = None
        self._byte_level = self._uses_byte_level_decoder()
        self._byte_decoder: Optional[dict[str, int]] = _gpt2_byte_decoder() if self._byte_level else None

    # --- vocabulary -----------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary + added tokens)."""
        return len(self.hf)

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.hf.eos_token_id

    @property
    def chat_template(self) -> Optional[str]:
        return getattr(self.hf, "chat_template", None)

    def _uses_byte_level_decoder(self) -> bool:
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            return False
        try:
            import json

            dec = json.loads(backend.to_str()).get("decoder") or {}
        except Exception:
            return False

        def has_byte_level(d: dict) -> bool:
            if d.get("type") == "ByteLevel":
                return True
            return any(has_byte_level(x) for x in d.get("decoders", []) or [] if isinstance(x, dict))

        return has_byte_level(dec)

    @property
    def max_chars_per_token(self) -> int:
        """Upper bound on the characters one token covers (longest vocabulary piece)."""
        if self._max_piece is None:
            pieces = self.hf.convert_ids_to_tokens(list(range(len(self.hf))))
            self._max_piece = max((len(p) for p in pieces if p), default=1)
        return self._max_piece

    def surely_longer_than(self, text: str, n_tokens: int) -> bool:
        """True when ``text`` must encode to more than ``n_tokens`` tokens (checked without encoding).

        Lets the server refuse a huge prompt before spending seconds tokenizing
        it; the factor 2 leaves room for normalizers that change the length.
        """
        return len(text) > 2 * self.max_chars_per_token * (n_tokens + 1)

    # --- encode / decode ------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (U+FFFD for a partial UTF-8 byte)."""
        return self.hf.decode([int(token_id)], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> list[int]:
        """The exact UTF-8 bytes one token stands for."""
        piece = self.hf.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return []
        if piece in getattr(self.hf, "all_special_tokens", ()):
            return list(piece.encode("utf-8"))
        m = _BYTE_FALLBACK.match(piece)
        if m:
            return [int(m.group(1), 16)]
        if self._byte_decoder is not None and all(c in self._byte_decoder for c in piece):
            return [self._byte_decoder[c] for c in piece]
        return list(piece.replace("\u2581", " ").encode("utf-8"))

    # --- chat -----------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: Optional[list[dict]] = None,
        continue_final_message: bool = False,
        template_kwargs: Optional[dict] = None,
        limits: RenderLimits = RenderLimits(),
    ) -> str:
        """Render an OpenAI-style conversation to the model's prompt text within ``limits``.

        ``template_kwargs`` are passed to the template as they are: the HTTP layer admits only
        ``kvship.engine.chat_template.TEMPLATE_KWARGS`` (``check_template_kwargs``)."""
        if not self.chat_template:
            raise ChatTemplateError("this model's tokenizer has no chat template; use /v1/completions instead")
        if not messages:
            raise ChatTemplateError("messages must not be empty")
        rendered: list[dict] = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatTemplateError(f"messages[{i}] must be an object with a 'role'")
            msg = dict(m)
            msg["content"] = _message_text(m.get("content"), i)
            rendered.append({k: v for k, v in msg.items() if v is not None})
        return render(
            self.chat_template,
            rendered,
            limits=limits,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            tools=tools or None,
            special_tokens=self._special_tokens(),
            template_kwargs=template_kwargs,
        )

    def _special_tokens(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``... as templates read them (transformers passes the same map)."""
        return {
            k: str(v) for k, v in (getattr(self.hf, "special_tokens_map", None) or {}).items() if isinstance(v, str)
        }

    def encode_chat(self, messages: list[dict], **kwargs: Any) -> list[int]:
        """Chat prompt ids: the template already places BOS, so no special tokens are added."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


@lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-character map used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}
