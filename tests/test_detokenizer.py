"""Incremental detokenization (multi-byte UTF-8, byte fallback) and stop-string handling."""

from __future__ import annotations

import json
import random

import pytest

from kvship.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "hello 你好 world 🎉 fox ü",
    "日本語のテキスト and emoji 👩‍👩‍👧 family",
    "naïve café — “quotes” ∑ ∫ ≈ 😀😃😄",
    "plain ascii only, nothing special here.",
    "🙂🙂🙂 repeated 🙂 emoji 🙂",
]


def build_byte_fallback_tokenizer():
    """A SentencePiece-style BPE whose unknown characters fall back to ``<0xNN>`` byte tokens."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [
        "hello world this is a test of the tokenizer",
        "the quick brown fox jumps over the lazy dog",
        "emoji and plain text",
    ] * 10
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    # byte tokens are ordinary vocabulary entries (as in Llama's tokenizer), not special tokens
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = {}
    for piece in ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]:
        vocab[piece] = len(vocab)
    for piece, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    spec["model"]["vocab"] = vocab
    for added in spec["added_tokens"]:
        added["id"] = vocab[added["content"]]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def byte_fallback_tok():
    return build_byte_fallback_tokenizer()


@pytest.fixture(scope="module")
def byte_level_tok():
    from conftest import build_tiny_tokenizer

    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def smollm2_tok(smollm2_path):
    from kvship.engine.tokenizer import load_tokenizer

    return load_tokenizer(smollm2_path).hf


def _stream(tok, ids, sizes):
    d = IncrementalDetokenizer(tok)
    deltas, i = [], 0
    for n in sizes:
        deltas.append(d.add(ids[i : i + n]))
        i += n
    deltas.append(d.add(ids[i:]))
    deltas.append(d.finish())
    return deltas


@pytest.mark.parametrize("tok_name", ["byte_fallback_tok", "byte_level_tok", "smollm2_tok"])
def test_streamed_multibyte_text_has_no_replacement_chars_and_equals_decode(tok_name, request):
    tok = request.getfixturevalue(tok_name)
    rng = random.Random(0)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        pieces = tok.convert_ids_to_tokens(ids)
        if tok_name == "byte_fallback_tok" and text != TEXTS[3]:
            assert any(p.startswith("<0x") for p in pieces), "the text must exercise byte-fallback pieces"
        for sizes in ([1] * len(ids), [rng.randint(1, 3) for _ in range(len(ids))]):
            deltas = _stream(tok, ids, sizes)
            assert all("\ufffd" not in d for d in deltas), deltas
            assert "".join(deltas) == tok.decode(ids) == text


def test_multibyte_character_is_held_until_complete(byte_fallback_tok):
    ids = byte_fallback_tok.encode("🎉", add_special_tokens=False)
    assert byte_fallback_tok.convert_ids_to_tokens(ids)[-4:] == ["<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    d = IncrementalDetokenizer(byte_fallback_tok)
    out = [d.add([t]) for t in ids]
    assert out == [""] * (len(ids) - 1) + ["🎉"]
    assert d.text == "🎉"


def test_incomplete_sequence_is_flushed_on_finish_like_decode(byte_level_tok):
    ids = byte_level_tok.encode("ok 🙂", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte never arrives
    d = IncrementalDetokenizer(byte_level_tok)
    streamed = "".join(d.add([t]) for t in cut)
    assert "\ufffd" not in streamed
    assert streamed + d.finish() == byte_level_tok.decode(cut)


def test_special_tokens_are_skipped_unless_asked(byte_level_tok):
    ids = byte_level_tok.encode("hello", add_special_tokens=False) + [byte_level_tok.eos_token_id]
    skip = IncrementalDetokenizer(byte_level_tok, skip_special_tokens=True)
    keep = IncrementalDetokenizer(byte_level_tok, skip_special_tokens=False)
    assert skip.add(ids) + skip.finish() == "hello"
    assert keep.add(ids) + keep.finish() == "hello</s>"


def test_finish_without_new_tokens_returns_nothing(byte_level_tok):
    d = IncrementalDetokenizer(byte_level_tok)
    assert d.add(byte_level_tok.encode("abc", add_special_tokens=False)) == "abc"
    assert d.finish() == ""
    assert d.add([]) == ""


# ---------------------------------------------------------------- stop strings


def _feed_all(matcher, pieces):
    out = []
    for p in pieces:
        m = matcher.feed(p)
        out.append(m.text)
        if m.matched is not None:
            return "".join(out), m.matched
    out.append(matcher.flush())
    return "".join(out), None


def test_stop_string_is_trimmed_and_ends_output():
    m = StopStringMatcher(["STOP"])
    text, matched = _feed_all(m, ["abc ", "ST", "OP", " never"])
    assert (text, matched) == ("abc ", "STOP")
    assert m.feed("more").text == ""


def test_possible_stop_prefix_is_held_back_then_released():
    m = StopStringMatcher(["Hello!"])
    r1 = m.feed("say Hel")
    assert r1.text == "say " and r1.matched is None  # "Hel" could start the stop string
    r2 = m.feed("lo?")
    assert r2.text == "Hello?" and r2.matched is None  # it did not: released in order
    assert m.flush() == ""


def test_held_text_is_flushed_when_output_ends_without_match():
    m = StopStringMatcher(["</answer>"])
    assert m.feed("42 </ans").text == "42 "
    assert m.flush() == "</ans"


def test_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(["world", "lo w"])
    text, matched = _feed_all(m, ["hello world"])
    assert (text, matched) == ("hel", "lo w")


def test_stop_string_split_over_many_single_character_deltas():
    m = StopStringMatcher(["\n\nUser:"])
    text, matched = _feed_all(m, list("answer.\n\nUser: next"))
    assert (text, matched) == ("answer.", "\n\nUser:")


def test_without_stop_strings_text_passes_through():
    m = StopStringMatcher([])
    assert m.feed("anything").text == "anything"
    assert m.flush() == ""


def test_multibyte_stop_string_through_detokenizer(byte_fallback_tok):
    ids = byte_fallback_tok.encode("the fox 你好 jumps", add_special_tokens=False)
    d = IncrementalDetokenizer(byte_fallback_tok)
    m = StopStringMatcher(["你好"])
    emitted, matched = [], None
    for t in ids:
        r = m.feed(d.add([t]))
        emitted.append(r.text)
        if r.matched:
            matched = r.matched
            break
    assert matched == "你好"
    assert "".join(emitted) == "the fox "
    assert all("\ufffd" not in e for e in emitted)
