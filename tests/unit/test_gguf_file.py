"""services/common/gguf_file.py against gguf's own GGUFReader (the format's reference reader), on a
file gguf's GGUFWriter wrote with every value type, arrays of numbers and of strings, and tensors
in float32 and in quantized blocks; its copies without some fields, as that reader reads them; and
what it says of files that are not GGUF."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from services.common.gguf_file import GGUFFile


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ▁wörld")
    writer.add_array("t.tokens", ["<s>", "", "▁a", "日本"])
    writer.add_array("t.scores", [0.5, -1.25, 3.0])
    writer.add_array("t.types", [1, 2, 3, 6])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 64), dtype=np.float32))
    q8 = rng.integers(0, 256, size=(4, 2 * 34), dtype=np.uint8)  # 4 rows of two Q8_0 blocks
    writer.add_tensor("q8", q8, raw_shape=q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_same_fields_and_tensors_as_ggufs_reader(written: Path):
    ours, reference = GGUFFile(written), gguf.GGUFReader(written)
    keys = [key for key in reference.fields if not key.startswith("GGUF.")]  # the reader's own pseudo-fields
    assert ours.keys() == keys
    for key in keys:
        assert ours.field(key) == reference.fields[key].contents(), key
    assert ours.field("t.u64") == 2**63 + 5 and ours.field("t.tokens") == ["<s>", "", "▁a", "日本"]
    assert ours.field("absent") is None
    assert list(ours.tensors) == [t.name for t in reference.tensors] == ["f32", "q8"]
    for tensor in reference.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.tensor_type == int(tensor.tensor_type)
        assert mine.shape == tuple(int(n) for n in tensor.shape)
        assert np.array_equal(mine.data, np.asarray(tensor.data).view(np.uint8).reshape(-1))
    assert ours.tensors["q8"].shape == (64, 4) and ours.tensors["q8"].data.size == 4 * 2 * 34


def test_a_copy_without_fields_keeps_every_other_field_and_tensor(written: Path, tmp_path: Path):
    original = GGUFFile(written)
    copy_path = tmp_path / "lean.gguf"
    original.write_without({"t.tokens", "t.scores"}, copy_path, {"llama.vocab_size": 4, "t.u32": 7})
    copy, reference = GGUFFile(copy_path), gguf.GGUFReader(copy_path)
    kept = [key for key in original.keys() if key not in ("t.tokens", "t.scores", "t.u32")]
    assert copy.keys() == kept + ["llama.vocab_size", "t.u32"]
    for key in kept:
        assert copy.field(key) == original.field(key) == reference.fields[key].contents(), key
    assert copy.field("llama.vocab_size") == reference.fields["llama.vocab_size"].contents() == 4
    assert copy.field("t.u32") == 7  # replaced
    assert [t.name for t in reference.tensors] == list(original.tensors)
    for tensor in reference.tensors:
        assert np.array_equal(np.asarray(tensor.data).view(np.uint8).reshape(-1), original.tensors[tensor.name].data)
    assert copy_path.stat().st_size < written.stat().st_size


def test_what_is_not_a_gguf_file_is_a_value_error(written: Path, tmp_path: Path):
    data = written.read_bytes()
    cases = {"magic": b"GGML" + data[4:],
             "truncated": data[: len(data) // 2],
             "big-endian": data[:4] + (3).to_bytes(4, "big") + data[8:],
             "empty": b""}
    for name, content in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(content)
        with pytest.raises(ValueError):
            GGUFFile(path)
