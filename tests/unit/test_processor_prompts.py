"""The processor's prompt handling: truncation, the chat-template kwargs a request may set, the
vocabulary check, detokenization and token strings."""

from __future__ import annotations

import pytest

from services.processor.processor import Processor
from services.processor.tokenizer import TokenizerInfo, chat_template_variables

MAX_MODEL_LEN = 64
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def processor(tokenizer) -> Processor:
    return Processor(tokenizer, TokenizerInfo.from_tokenizer(tokenizer), MAX_MODEL_LEN)


def test_truncate_keeps_the_last_tokens(processor):
    ids = list(range(10, 20))
    assert processor.truncate(ids, None) == ids
    assert processor.truncate(ids, 3) == [17, 18, 19]
    assert processor.truncate(ids, 50) == ids
    assert processor.truncate(list(range(100)), -1) == list(range(100 - MAX_MODEL_LEN, 100))
    for bad in (0, -2, MAX_MODEL_LEN + 1):
        with pytest.raises(ValueError, match=rf"truncate_prompt_tokens must be -1 or in \[1, {MAX_MODEL_LEN}\]"):
            processor.truncate(ids, bad)


def test_template_kwargs_are_those_the_template_reads(processor, tokenizer):
    assert chat_template_variables(tokenizer) == {"messages", "add_generation_prompt"}
    # Ours are not the request's to set; tools and documents reach any template that reads them.
    assert processor.template_kwargs == {"tools", "documents"}
    assert processor.template_kwargs_of({"enable_thinking": False, "tools": []}) == {"tools": []}
    for reserved in ("chat_template", "tokenize", "add_generation_prompt", "messages"):
        with pytest.raises(ValueError, match=f"chat_template_kwargs may not set {reserved}"):
            processor.template_kwargs_of({reserved: "x"})
    with pytest.raises(ValueError, match="may not set chat_template"):
        processor.tokenize_chat(CHAT, chat_template_kwargs={"chat_template": "{{ 'pwned' }}"})
    assert processor.tokenize_chat(CHAT, chat_template_kwargs={"enable_thinking": True}) == processor.tokenize_chat(CHAT)


def test_detokenize_and_token_strs(processor, tokenizer):
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    assert processor.detokenize(ids) == "Hello world"
    assert processor.token_strs(ids) == ["Hello", "Ġworld"]
    assert processor.detokenize([tokenizer.convert_tokens_to_ids("<|im_start|>")]) == "<|im_start|>"
    for bad in ([len(tokenizer)], [-1]):
        with pytest.raises(ValueError, match="out of vocabulary"):
            processor.detokenize(bad)
