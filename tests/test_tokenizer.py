"""The tokenizer front: Hugging Face folders, GGUF metadata (with its disk cache), chat templates, token bytes."""

from __future__ import annotations

import os

import pytest

from kvship.engine.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer

SAMPLES = ["What is the capital of France?", "naïve café 日本語 🙂", "  leading spaces\nand lines\t", "1234567890"]


@pytest.fixture(scope="module")
def tiny_tok(tiny_llama_dir) -> Tokenizer:
    return load_tokenizer(tiny_llama_dir)


@pytest.fixture(scope="module")
def smol_tok(smollm2_path) -> Tokenizer:
    return load_tokenizer(smollm2_path)


def test_folder_tokenizer_round_trips_text(tiny_tok):
    for text in SAMPLES:
        assert tiny_tok.decode(tiny_tok.encode(text, add_special_tokens=False)) == text
    assert tiny_tok.eos_token_id == 2
    assert tiny_tok.vocab_size == len(tiny_tok.hf)


def test_folder_tokenizer_renders_chat_with_generation_prompt(tiny_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tiny_tok.apply_chat_template(msgs)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not tiny_tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    ids = tiny_tok.encode_chat(msgs)
    assert tiny_tok.decode(ids, skip_special_tokens=False) == text
    im_start = tiny_tok.hf.convert_tokens_to_ids("<|im_start|>")
    assert ids[0] == im_start  # no BOS added on top of the template


def test_text_content_parts_are_joined(tiny_tok):
    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    assert tiny_tok.apply_chat_template([{"role": "user", "content": parts}]) == tiny_tok.apply_chat_template(
        [{"role": "user", "content": "Hello, world"}]
    )


@pytest.mark.parametrize(
    "messages",
    [
        [],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": 42}],
        [{"content": "no role"}],
    ],
)
def test_unrenderable_conversations_raise_chat_template_error(tiny_tok, messages):
    with pytest.raises(ChatTemplateError):
        tiny_tok.apply_chat_template(messages)


def test_template_raise_exception_becomes_chat_template_error(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    tok.hf.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}x"
    )
    with pytest.raises(ChatTemplateError, match="first must be user"):
        tok.apply_chat_template([{"role": "assistant", "content": "hi"}])


def test_tokenizer_without_template_refuses_chat(tiny_llama_dir):
    tok = load_tokenizer(tiny_llama_dir)
    tok.hf.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_gguf_tokenizer_comes_from_metadata_with_chat_template(smol_tok):
    assert smol_tok.vocab_size == 49152
    assert smol_tok.eos_token_id == 2  # <|im_end|>
    text = smol_tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    for s in SAMPLES:
        assert smol_tok.decode(smol_tok.encode(s)) == s


def test_gguf_tokenizer_cache_gives_the_same_tokenizer(smollm2_path, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("KVSHIP_CACHE_DIR", str(tmp_path))
    first = load_tokenizer(smollm2_path)  # converts and writes the cache
    cached_dirs = os.listdir(tmp_path / "gguf-tokenizers")
    assert len(cached_dirs) == 1 and not cached_dirs[0].count(".tmp")
    second = load_tokenizer(smollm2_path)  # reads the cache
    direct = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))
    for s in SAMPLES:
        assert first.encode(s) == second.encode(s) == direct.encode(s)
    assert second.chat_template == direct.chat_template
    assert second.eos_token_id == direct.eos_token_id


@pytest.mark.parametrize("which", ["tiny_tok", "smol_tok"])
def test_token_bytes_concatenate_to_the_utf8_text(which, request):
    tok: Tokenizer = request.getfixturevalue(which)
    for s in SAMPLES:
        ids = tok.encode(s, add_special_tokens=False)
        assert bytes(b for t in ids for b in tok.token_bytes(t)) == s.encode("utf-8")


def test_token_bytes_of_byte_fallback_pieces():
    from test_detokenizer import build_byte_fallback_tokenizer

    tok = Tokenizer(build_byte_fallback_tokenizer())
    ids = tok.encode("fox 🎉", add_special_tokens=False)
    joined = bytes(b for t in ids for b in tok.token_bytes(t))
    assert joined.strip() == "fox 🎉".encode()


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope.gguf"))


@pytest.mark.parametrize("which", ["tiny_tok", "smol_tok"])
def test_length_precheck_never_refuses_a_text_that_fits(which, request):
    tok: Tokenizer = request.getfixturevalue(which)
    for text in SAMPLES + ["a" * 5000, "🙂" * 2000, " ".join(["word"] * 3000)]:
        n = len(tok.encode(text))
        assert not tok.surely_longer_than(text, n)  # never a false refusal
    assert tok.surely_longer_than("x" * 10**6, 100)
