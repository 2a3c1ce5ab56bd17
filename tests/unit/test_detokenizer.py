"""Incremental detokenizer and tokenizer helpers.

The detokenizer's contract: streamed deltas (plus `flush()`) concatenate to exactly the one-shot
`tokenizer.decode(output_ids, skip_special_tokens=...)`, and no delta ends in half a character.
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from services.processor.detokenizer import IncrementalDetokenizer
from services.processor.tokenizer import (
    TokenizerInfo,
    apply_chat_template,
    eos_token_ids,
    load_tokenizer,
)

FFFD = "\ufffd"
# Multi-byte text: skin-tone emoji (a ZWJ-less 2-code-point cluster), a flag (2 regional indicators),
# CJK, accented Latin. Byte-level BPE and byte-fallback tokenizers split these over several tokens.
PIECES = ["👍🏽", "🇯🇵", "日本語の文章", "é", "ñandú", "Zürich", "naïve", "😀", "中文", "한국어", "ü"]
ASCII_WORDS = ["hello", "world", "the", " ", "  ", "\n", ".", ",", "stop", "a", "42", "{", "}", "'s"]


def random_text(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES if rng.random() < 0.4 else ASCII_WORDS) + rng.choice(["", " "])
                   for _ in range(rng.randint(1, 25)))


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feeds `ids` in random chunks of 1-4 tokens; returns the deltas, the final flush last."""
    deltas = []
    i = 0
    while i < len(ids):
        n = rng.randint(1, 4)
        deltas.append(detok.update(ids[i:i + n]))
        i += n
    deltas.append(detok.flush())
    return deltas


def check_stream(tokenizer: PreTrainedTokenizerBase, ids: list[int], rng: random.Random,
                 skip_special_tokens: bool) -> None:
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], skip_special_tokens=skip_special_tokens)
    deltas = stream(detok, ids, rng)
    assert "".join(deltas) == expected, (ids, deltas)
    assert detok.output_text == expected
    # A U+FFFD in a delta must be one the one-shot decode has at the same place (random ids can
    # spell genuinely invalid UTF-8); a half-finished character is never emitted as one.
    pos = 0
    for delta in deltas:
        for j, ch in enumerate(delta):
            if ch == FFFD:
                assert expected[pos + j] == FFFD
        pos += len(delta)


# --- SmolLM2: GPT-2 style byte-level BPE -----------------------------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_stream_equals_one_shot_decode(tokenizer, skip_special_tokens):
    rng = random.Random(1234 + skip_special_tokens)
    vocab_size = len(tokenizer)
    for _ in range(100):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 40))]
        if rng.random() < 0.3:  # special tokens (ids 0..16 in SmolLM2) mixed in
            ids[rng.randrange(len(ids))] = rng.randrange(17)
        check_stream(tokenizer, ids, rng, skip_special_tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_multibyte_text_stream_equals_one_shot_decode(tokenizer, skip_special_tokens):
    rng = random.Random(99 + skip_special_tokens)
    for _ in range(100):
        text = random_text(rng)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if rng.random() < 0.3:  # a special token between two texts
            ids += [tokenizer.convert_tokens_to_ids("<|im_end|>")]
            ids += tokenizer.encode(random_text(rng), add_special_tokens=False)
        check_stream(tokenizer, ids, rng, skip_special_tokens)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert FFFD not in expected  # valid text: so no delta had one either


def test_emoji_is_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("ok 👍🏽!", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.update([t]) for t in ids]
    # Each delta is whole characters; the emoji's first tokens emit nothing, the one completing it
    # emits it all.
    assert "".join(deltas) == "ok 👍🏽!"
    assert all(FFFD not in d for d in deltas)
    assert deltas[0] == "ok"
    assert "" in deltas
    assert detok.flush() == ""


def test_window_stays_short(tokenizer):
    """Per-token work is a decode of a few ids, not of the whole output."""
    ids = tokenizer.encode("The quick brown fox 日本語の文章 jumps 👍🏽 over the lazy dog. " * 20,
                           add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    for t in ids:
        detok.update([t])
        assert len(detok.token_ids) - detok._prefix_offset <= 8
    assert detok.output_text == tokenizer.decode(ids)


def test_invalid_bytes_at_the_end_are_flushed(tokenizer):
    # The first two of the three tokens of "日" (a dangling UTF-8 lead): never completed.
    ids = tokenizer.encode("a日", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.update(ids) == "a"
    assert detok.flush() == tokenizer.decode(ids)[1:]
    assert detok.output_text == tokenizer.decode(ids)


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hi<|im_end|> there", add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in ids
    for skip, text in [(True, "hi there"), (False, "hi<|im_end|> there")]:
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        assert "".join(detok.update([t]) for t in ids) + detok.flush() == text


# --- SentencePiece-style tokenizer with byte-fallback tokens (<0xE6> ...) ----------------------------


@pytest.fixture(scope="module")
def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A tiny Llama-2-like tokenizer: Unigram with byte fallback, Metaspace pre-tokenizer, and the
    Llama decoder chain (▁ → space, byte fallback, fuse, strip the first space). Characters outside
    its small vocabulary are spelled as <0x..> byte tokens."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    pieces = ["▁", *"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?'-{}\n",
              "▁the", "▁hello", "▁world", "ing", "é", "日", "本", "▁café", "▁stop"]
    vocab = ([(t, 0.0) for t in specials] + [(t, -100.0) for t in byte_tokens]
             + [(p, -5.0 + 0.5 * len(p)) for p in pieces])
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_byte_fallback_tokenizer_spells_bytes(byte_fallback_tokenizer):
    tokens = byte_fallback_tokenizer.tokenize("日本語")
    assert tokens[:4] == ["▁", "日", "本", "<0xE8>"]
    assert byte_fallback_tokenizer.decode(byte_fallback_tokenizer.encode("日本語 👍🏽")) == "日本語 👍🏽"


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_fallback_stream_equals_one_shot_decode(byte_fallback_tokenizer, skip_special_tokens):
    tok = byte_fallback_tokenizer
    rng = random.Random(7 + skip_special_tokens)
    byte_ids = set(tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in range(256)]))
    # Random ids other than byte tokens: a random run of byte tokens is invalid UTF-8, which a
    # byte-fallback decoder spells retroactively (see the detokenizer's docstring).
    other_ids = [i for i in range(len(tok)) if i not in byte_ids]
    for _ in range(100):
        ids: list[int] = []
        for _ in range(rng.randint(1, 5)):
            if rng.random() < 0.7:
                ids += tok.encode(random_text(rng), add_special_tokens=False)
            else:
                ids += [rng.choice(other_ids) for _ in range(rng.randint(1, 4))]
        check_stream(tok, ids, rng, skip_special_tokens)


def test_byte_fallback_holds_back_partial_character(byte_fallback_tokenizer):
    tok = byte_fallback_tokenizer
    ids = tok.encode("hello 語!", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids) == ["▁hello", "▁", "<0xE8>", "<0xAA>", "<0x9E>", "!"]
    detok = IncrementalDetokenizer(tok, [])
    # The Strip decoder drops the output's first space, as the one-shot decode does.
    assert [detok.update([t]) for t in ids] == ["hello", " ", "", "", "語", "!"]
    assert detok.output_text == tok.decode(ids) == "hello 語!"


# --- tokenizer helpers ------------------------------------------------------------------------------


SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


def test_chat_template_user_message(tokenizer):
    ids = apply_chat_template(tokenizer, [{"role": "user", "content": "hi"}])
    assert isinstance(ids, list) and all(type(t) is int for t in ids)
    # SmolLM2's own template adds its default system message when the chat has none.
    expected = SMOLLM2_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected
    assert ids == tokenizer.encode(expected, add_special_tokens=False)
    assert ids[-4:] == tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)


def test_chat_template_with_system_message_and_options(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = apply_chat_template(tokenizer, messages)
    assert tokenizer.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    no_prompt = apply_chat_template(tokenizer, messages, add_generation_prompt=False)
    assert ids[:len(no_prompt)] == no_prompt and len(no_prompt) < len(ids)
    with pytest.raises(ValueError):
        apply_chat_template(tokenizer, messages, continue_final_message=True)


def test_eos_token_ids(tokenizer, tmp_path):
    assert tokenizer.eos_token == "<|im_end|>"
    assert eos_token_ids(tokenizer) == [2]
    assert eos_token_ids(tokenizer, tmp_path) == [2]  # a folder without generation_config.json
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert eos_token_ids(tokenizer, tmp_path) == [2, 0]
    assert eos_token_ids(tokenizer, tmp_path / "generation_config.json") == [2, 0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    assert eos_token_ids(tokenizer, tmp_path) == [2, 0]
    with pytest.raises(FileNotFoundError):
        eos_token_ids(tokenizer, tmp_path / "missing.json")


def test_tokenizer_info(tokenizer):
    info = TokenizerInfo.from_tokenizer(tokenizer)
    assert info == TokenizerInfo(vocab_size=49152, bos_token_id=tokenizer.bos_token_id, eos_token_ids=(2,),
                                 has_chat_template=True, max_token_chars=81)


def test_load_tokenizer_refuses_what_is_not_local(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_tokenizer(tmp_path / "no-such-model")
