"""Chat for a model without a chat template, through the gateway app in-process: Gemma 3 270M is a
base model whose GGUF carries no `tokenizer.chat_template`, so /v1/chat/completions is a 400 that
says what to do, while /v1/completions works; with `--chat-template` (Jinja text or a file) the same
request renders through the given template. The engine is scripted (tests/unit/test_gateway.py):
only the tokenizer is real."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2 as httpx
import pytest

from services.common.gguf_file import GGUFFile
from services.common.model_files import GEMMA3_MODEL, locate_model, resolve_tokenizer
from services.gateway.app import create_app
from services.processor.async_processor import AsyncProcessor
from services.processor.processor import Processor
from services.processor.server import build_parser
from services.processor.tokenizer import load_chat_template, load_tokenizer

from tests.unit.test_gateway import MAX_MODEL_LEN, ScriptedEngine, assert_openai_error

pytestmark = pytest.mark.anyio

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
            "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
CHAT = {"model": GEMMA3_MODEL, "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4}


@pytest.fixture(scope="module")
def tokenizer_folder() -> Path:
    return resolve_tokenizer(GEMMA3_MODEL)


@pytest.fixture(scope="module")
def gemma3_tokenizer(tokenizer_folder: Path):
    return load_tokenizer(tokenizer_folder)


async def client_for(tokenizer, folder: Path) -> tuple[httpx.AsyncClient, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer, tokenizer.eos_token_id)
    app = create_app(AsyncProcessor(Processor.for_tokenizer(tokenizer, folder, MAX_MODEL_LEN), engine), GEMMA3_MODEL)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test"), engine


@pytest.fixture(scope="module")
async def base_model(gemma3_tokenizer,
                     tokenizer_folder: Path) -> AsyncIterator[tuple[httpx.AsyncClient, ScriptedEngine]]:
    client, engine = await client_for(gemma3_tokenizer, tokenizer_folder)
    async with client:
        yield client, engine


def test_the_gemma3_gguf_carries_no_chat_template() -> None:
    assert GGUFFile(locate_model(GEMMA3_MODEL)).field("tokenizer.chat_template") is None


@pytest.mark.slow  # over a second: `make test`, not test-fast
async def test_chat_without_a_template_is_a_400_that_names_the_flag(base_model) -> None:
    client, engine = base_model
    error = assert_openai_error(await client.post("/v1/chat/completions", json=CHAT), 400)
    assert error["type"] == "invalid_request_error"
    assert "has none (a base model)" in error["message"] and "--chat-template" in error["message"]
    assert not engine.requests  # refused before any engine work
    completion = await client.post("/v1/completions", json={"model": GEMMA3_MODEL, "prompt": "Hi", "max_tokens": 4})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"]


@pytest.mark.slow  # over a second: `make test`, not test-fast
async def test_chat_template_flag_renders_chat(gemma3_tokenizer, tokenizer_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "gemma.jinja").write_text(TEMPLATE)
    # What load_tokenizer does with --chat-template, on a copy: loading the 262k-token vocabulary again
    # would cost seconds (test_flag_replaces_the_models_own_template covers load_tokenizer itself).
    tokenizer = copy.copy(gemma3_tokenizer)
    tokenizer.chat_template = load_chat_template(str(tmp_path / "gemma.jinja"))
    client, engine = await client_for(tokenizer, tokenizer_folder)
    async with client:
        response = await client.post("/v1/chat/completions", json=CHAT)
    assert response.status_code == 200, response.text
    rendered = "<bos><start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n"
    assert engine.requests[0].prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_flag_replaces_the_models_own_template(model_path: Path) -> None:
    assert load_tokenizer(model_path).chat_template != TEMPLATE  # SmolLM2 has a template of its own
    assert load_tokenizer(model_path, TEMPLATE).chat_template == TEMPLATE
    assert "--chat-template" in build_parser().format_help()


def test_bad_chat_template_fails_at_start_up(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a Jinja template nor a readable file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse as Jinja"):
        load_chat_template("{% for m in messages %}never closed")
