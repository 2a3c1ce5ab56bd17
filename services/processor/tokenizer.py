"""The model's Hugging Face tokenizer: loading, the model's own chat template, eos ids."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from services.common.model_files import TOKENIZER_FILE, gguf_tokenizer

GENERATION_CONFIG_NAME = "generation_config.json"


def load_tokenizer(path: str | os.PathLike[str], chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """Loads the tokenizer of a local model: a Hugging Face folder with a tokenizer.json, or a single
    `.gguf` file (built from its metadata, nothing cached). Never imports torch. `chat_template`
    (`--chat-template`: Jinja text or a file holding it) replaces the model's own.

    Only local paths: a hub id is refused here, so a typo never turns into a download. Not
    AutoTokenizer: it imports torch (through the model configs), and the processor must not.
    """
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        tokenizer = gguf_tokenizer(path)
    elif not path.is_dir():
        raise FileNotFoundError(f"no tokenizer at {path}: expected a model folder or a .gguf file")
    elif not (path / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"model folder {path} has no {TOKENIZER_FILE}: only fast tokenizers are supported")
    else:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    if chat_template is not None:
        tokenizer.chat_template = load_chat_template(chat_template)
    return tokenizer


def load_chat_template(template: str) -> str:
    """`--chat-template`'s Jinja text: the value itself when it reads as a template (vLLM's rule: it
    holds a brace or a newline), else the file it names. ValueError for a file that cannot be read or
    a template that does not parse, so that a bad flag fails at start-up, not at the first chat."""
    if not any(c in template for c in "{}\n"):
        try:
            template = Path(template).expanduser().read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--chat-template {template!r} is neither a Jinja template nor a readable file: "
                             f"{e.strerror}") from None
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template does not parse as Jinja (line {e.lineno}): {e.message}") from None
    return template


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    **template_kwargs: Any,
) -> list[int]:
    """Renders `messages` with the model's own chat template and returns the prompt's token ids.

    `template_kwargs` go to `tokenizer.apply_chat_template` (`tools`, `documents`, `chat_template`,
    or variables the template reads). The template writes the special tokens itself, so none are
    added around it. Raises ValueError when the tokenizer has no chat template, or when the template
    fails on these messages (a message without content, say).
    """
    try:
        out = tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=False,
            **template_kwargs,
        )
    except (jinja2.TemplateError, TypeError) as e:  # the messages are not what the template expects
        raise ValueError(f"the chat template cannot render these messages: {e}") from None
    # transformers 5 returns a BatchEncoding when return_dict is left at its default; older ones a list.
    if isinstance(out, Mapping):
        out = out["input_ids"]
    return [int(t) for t in out]


def chat_template_variables(tokenizer: PreTrainedTokenizerBase) -> frozenset[str]:
    """The variables the tokenizer's chat template reads from outside (`messages`, `tools`, ...)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one is used
        template = template.get("default", "")
    environment = jinja2.Environment()
    return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template or "")))


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase,
    generation_config_path: str | os.PathLike[str] | None = None,
) -> list[int]:
    """The ids that end a generation: the tokenizer's eos, then those of `generation_config.json`.

    `generation_config_path` is the json file or the model folder; a folder without the file adds
    nothing (a GGUF model has none), a file path that does not exist is an error. Order is kept,
    duplicates dropped.
    """
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if generation_config_path is not None:
        path = Path(generation_config_path)
        if path.is_dir():
            path = path / GENERATION_CONFIG_NAME
            if not path.is_file():
                return ids
        with open(path, encoding="utf-8") as f:
            eos = json.load(f).get("eos_token_id")
        if isinstance(eos, int):
            eos = [eos]
        for token_id in eos or ():
            if int(token_id) not in ids:
                ids.append(int(token_id))
    return ids


@dataclass(frozen=True)
class TokenizerInfo:
    """The facts about a tokenizer that request validation needs, found once at start-up."""

    vocab_size: int  # len(tokenizer): base vocab plus added tokens; every valid id is below it
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    # Characters of the vocabulary's longest token (services/common/prompt_size.py): at most this
    # many characters of text per token.
    max_token_chars: int = 1

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: PreTrainedTokenizerBase,
        generation_config_path: str | os.PathLike[str] | None = None,
    ) -> TokenizerInfo:
        return cls(
            vocab_size=len(tokenizer),
            bos_token_id=tokenizer.bos_token_id,
            eos_token_ids=tuple(eos_token_ids(tokenizer, generation_config_path)),
            has_chat_template=tokenizer.chat_template is not None,
            max_token_chars=max_token_chars(tokenizer),
        )


def max_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """Characters of the longest token's text (a vocabulary of 50k tokens: a few tens of ms, once)."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(tokenizer.convert_tokens_to_string([p])) for p in pieces if p is not None), default=1) or 1
