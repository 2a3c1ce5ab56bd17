"""A GGUF file's header, read in milliseconds: its metadata and its tensors (memory-mapped).

gguf's own GGUFReader builds a numpy view per part of every field, so the default model's tokenizer
(49,152 tokens and 48,900 merges, each string a field part) took it 4 s, paid by every worker start
and every in-process LLM. This reader walks the header with struct over one mmap; an array is
decoded when it is asked for (`field`), so a worker that needs four numbers reads four numbers.
Only little-endian files (what llama.cpp writes; a big-endian one is refused with ValueError).

    f = GGUFFile(path)
    f.field("general.architecture")        # 'llama'; arrays come back as lists, as GGUFReader's contents()
    f.tensors["blk.0.attn_q.weight"]       # GGUFTensor(name, tensor_type, shape (fastest first), data)
    f.write_without({"tokenizer.ggml.tokens"}, out, {"llama.vocab_size": 49152})  # a leaner copy
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct formats of the scalars (8: string, 9: array).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: int  # a GGMLQuantizationType
    shape: tuple[int, ...]  # as GGUF lists it: the fastest dimension first
    data: np.ndarray  # the tensor's bytes (uint8, memory-mapped)


class GGUFFile:
    """ValueError for a file that is not GGUF (or is truncated, or big-endian)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            self._fields: dict[str, tuple[int, int]] = {}  # key -> (value type, offset of the value)
            self._spans: dict[str, tuple[int, int]] = {}  # key -> its bytes in the header, key included
            self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, KeyError, IndexError) as exc:
            raise ValueError(f"{self.path} is not a valid GGUF file ({exc})") from None

    # ------------------------------------------------------------------ the header

    def _parse(self) -> dict[str, GGUFTensor]:
        buf = self._map
        if buf[:4] != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file")
        version, num_tensors, num_fields = struct.unpack_from("<IQQ", buf, 4)
        if version & 0xFFFF == 0:
            raise ValueError(f"{self.path} is a big-endian GGUF file: not supported")
        pos = 24
        for _ in range(num_fields):
            key_start = pos
            key, pos = self._string(pos)
            (value_type,) = struct.unpack_from("<I", buf, pos)
            self._fields[key] = (value_type, pos + 4)
            pos = self._skip(value_type, pos + 4)
            self._spans[key] = (key_start, pos)
        self._infos_span = (pos, 0)
        infos = []
        for _ in range(num_tensors):
            name, pos = self._string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            tensor_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            infos.append((name, tensor_type, shape, offset))
            pos += 4 + 8 * n_dims + 12
        alignment = self.field("general.alignment") or DEFAULT_ALIGNMENT
        start = -(-pos // alignment) * alignment
        self._infos_span, self._alignment, self._data_start = (self._infos_span[0], pos), alignment, start
        whole = np.frombuffer(buf, dtype=np.uint8)
        tensors = {}
        for name, tensor_type, shape, offset in infos:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor_type)]
            count = int(np.prod(shape, dtype=np.int64))
            nbytes = count // block_size * type_size
            begin = start + offset
            if begin + nbytes > len(buf):
                raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
            tensors[name] = GGUFTensor(name, tensor_type, tuple(int(n) for n in shape), whole[begin:begin + nbytes])
        return tensors

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self._map, pos)
        end = pos + 8 + length
        if end > len(self._map):
            raise ValueError(f"{self.path}: a string runs past the end of the file")
        return self._map[pos + 8:end].decode("utf-8"), end

    def _skip(self, value_type: int, pos: int) -> int:
        """The offset after the value of `value_type` at `pos`."""
        if value_type in _SCALARS:
            return pos + struct.calcsize("<" + _SCALARS[value_type])
        if value_type == STRING:
            (length,) = struct.unpack_from("<Q", self._map, pos)
            return pos + 8 + length
        if value_type != ARRAY:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")
        item_type, count = struct.unpack_from("<IQ", self._map, pos)
        pos += 12
        if item_type in _SCALARS:
            return pos + count * struct.calcsize("<" + _SCALARS[item_type])
        for _ in range(count):  # strings (or nested arrays), one length at a time
            pos = self._skip(item_type, pos)
        return pos

    def write_without(self, drop: set[str], out: Path, add_uint32: dict[str, int] | None = None) -> None:
        """A copy of the file at `out` without the fields `drop`, with the uint32 fields `add_uint32`
        (replacing any of the same name): every other field, tensor and byte of data as they are here."""
        add = add_uint32 or {}
        kept = [key for key in self._fields if key not in drop and key not in add]
        with open(out, "wb") as f:
            f.write(self._map[:8])  # magic, version
            f.write(struct.pack("<QQ", len(self.tensors), len(kept) + len(add)))
            for key in kept:
                begin, end = self._spans[key]
                f.write(self._map[begin:end])
            for key, value in add.items():
                name = key.encode()
                f.write(struct.pack("<Q", len(name)) + name + struct.pack("<II", 4, value))
            begin, end = self._infos_span
            f.write(self._map[begin:end])  # tensor offsets are relative to the data: they still hold
            f.write(b"\0" * (-f.tell() % self._alignment))
            f.write(self._map[self._data_start:])

    # ------------------------------------------------------------------ the metadata

    def keys(self) -> list[str]:
        return list(self._fields)

    def field(self, key: str) -> object | None:
        """The value of `key` (None when absent): a str, a Python number, or a list of them."""
        if key not in self._fields:
            return None
        value_type, pos = self._fields[key]
        return self._value(value_type, pos)

    def _value(self, value_type: int, pos: int) -> object:
        if value_type in _SCALARS:
            return struct.unpack_from("<" + _SCALARS[value_type], self._map, pos)[0]
        if value_type == STRING:
            return self._string(pos)[0]
        item_type, count = struct.unpack_from("<IQ", self._map, pos)
        pos += 12
        if item_type in _NUMPY:
            return np.frombuffer(self._map, dtype=np.dtype(_NUMPY[item_type]).newbyteorder("<"), count=count,
                                 offset=pos).tolist()
        items = []
        for _ in range(count):
            items.append(self._value(item_type, pos))
            pos = self._skip(item_type, pos)
        return items
