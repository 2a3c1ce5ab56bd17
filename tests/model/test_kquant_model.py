"""A SmolLM2-shaped Llama (tied embeddings, GQA) whose weights a GGUF file holds in K-quant blocks, as
a Q4_K_M file mixes them: our model keeps every 2-D weight in the file's blocks and generates the
greedy tokens transformers generates over gguf-py's dequantization of them.

SmolLM2-135M's own rows (576 weights) are no whole number of 256-weight super-blocks, so the model is
a small random one with the same layout. Its weights are quantized by tests/kernels/kquant_blocks.py."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from kvmesh_kernels import cpu_fused_ops, cpu_quant_matmul
from kvmesh_kernels.cpu_quant_matmul import QuantType
from services.common.config import default_cache_dir
from services.worker.gguf_weights import GGUFWeights
from services.worker.loader import load_model
from tests.kernels.kquant_blocks import dequantize, quantize
from tests.model.test_model import kv_caches_for, make_metadata, run_step

# Weights drawn wider than transformers' default (0.02), under which a random model repeats one token:
# here each greedy token differs from the last, so a wrong weight shows.
CONFIG = dict(vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, rms_norm_eps=1e-5,
              initializer_range=0.08)
# GGUF tensor (the name's end) -> its blocks: one type per merged layer (q, k and v together; gate and up).
TYPES = {"attn_q": QuantType.Q4_K, "attn_k": QuantType.Q4_K, "attn_v": QuantType.Q4_K, "attn_output": QuantType.Q4_K,
         "ffn_gate": QuantType.Q5_K, "ffn_up": QuantType.Q5_K, "ffn_down": QuantType.Q6_K,
         "token_embd": QuantType.Q6_K}
NEW_TOKENS = 8


def _file_rows(gguf_name: str, rows: int) -> np.ndarray | None:
    """llama.cpp's row order of q and k (its RoPE's interleaved pairs), the inverse of GGUFWeights'."""
    heads = {"attn_q": CONFIG["num_attention_heads"], "attn_k": CONFIG["num_key_value_heads"]}
    heads = heads.get(gguf_name.split(".")[-1])
    if heads is None:
        return None
    return np.argsort(np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1))


def write_k_quant_model(folder: Path, gguf_path: Path) -> HFLlamaForCausalLM:
    """A random Llama saved to `folder` with its 2-D weights replaced by their K-quant dequantization,
    and those blocks in `gguf_path`. Returns the transformers model over the dequantized weights."""
    torch.manual_seed(0)
    hf_model = HFLlamaForCausalLM(LlamaConfig(**CONFIG)).eval()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, CONFIG["num_hidden_layers"])
    writer = gguf.GGUFWriter(gguf_path, "llama")
    writer.add_block_count(CONFIG["num_hidden_layers"])
    writer.add_head_count(CONFIG["num_attention_heads"])
    writer.add_head_count_kv(CONFIG["num_key_value_heads"])
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            gguf_name = names.get_name(name.removesuffix(".weight"))
            if param.dim() != 2 or gguf_name is None:
                continue
            qtype = TYPES[gguf_name.split(".")[-1]]
            blocks = quantize(param.numpy(), qtype)
            param.copy_(torch.from_numpy(dequantize(blocks, qtype, param.shape[1])))
            order = _file_rows(gguf_name, param.shape[0])
            writer.add_tensor(f"{gguf_name}.weight", blocks if order is None else blocks[order],
                              raw_dtype=gguf.GGMLQuantizationType(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    hf_model.save_pretrained(folder)
    return hf_model


def hf_parts(name: str) -> list[str]:
    """The transformers modules whose weights our merged module `name` stacks, in order."""
    for merged, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if merged in name:
            return [name.replace(merged, part) for part in parts]
    return [name]


def greedy(model: torch.nn.Module, config, prompt: list[int]) -> list[int]:
    """NEW_TOKENS greedy tokens: the prompt prefilled, then one decode step a token over the paged cache."""
    kv_caches = kv_caches_for(config)
    ids, table = list(prompt), [[3, 0, 5]]
    logits = run_step(model, torch.tensor(ids), make_metadata([len(ids)], [len(ids)], table), kv_caches)
    for _ in range(NEW_TOKENS - 1):
        ids.append(int(logits[-1].argmax()))
        logits = run_step(model, torch.tensor(ids[-1:]), make_metadata([1], [len(ids)], table), kv_caches)
    return ids[len(prompt):] + [int(logits[-1].argmax())]


def test_a_k_quant_llama_keeps_its_blocks_and_generates_transformers_greedy_tokens(tmp_path: Path) -> None:
    cpu_fused_ops.available(default_cache_dir())
    cpu_quant_matmul.build(default_cache_dir())
    hf_model = write_k_quant_model(tmp_path / "folder", tmp_path / "model.gguf")
    model, config = load_model(tmp_path / "folder", torch.float32, torch.device("cpu"),
                               gguf_weights=GGUFWeights(tmp_path / "model.gguf"))
    kept = {name: module.block_weight for name, module in model.named_modules()
            if getattr(module, "block_weight", None) is not None}
    assert len(kept) == 1 + 4 * config.num_hidden_layers  # embedding (= LM head), qkv, o, gate_up, down
    assert {w.qtype for w in kept.values()} == {QuantType.Q4_K, QuantType.Q5_K, QuantType.Q6_K}
    floats = dict(hf_model.named_modules())
    for name, weight in kept.items():  # q and k rows back in the model's order, every weight bit for bit
        assert torch.equal(weight.dequantize(), torch.cat([floats[part].weight for part in hf_parts(name)]))
    gen = torch.Generator().manual_seed(2)
    for length in (5, 19):
        prompt = torch.randint(0, CONFIG["vocab_size"], (length,), generator=gen).tolist()
        with torch.inference_mode():
            want = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                     min_new_tokens=NEW_TOKENS, pad_token_id=0)[0, length:].tolist()
        assert len(set(want)) > NEW_TOKENS // 2  # a sequence, not one token repeated
        assert greedy(model, config, prompt) == want


def test_other_k_quants_are_dequantized_and_one_line_names_them(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    # Q2_K and Q3_K (and the IQ types) have no kernel here: their layers take the folder's floats.
    types = {"attn_q": gguf.GGMLQuantizationType.Q3_K, "attn_k": gguf.GGMLQuantizationType.Q3_K,
             "ffn_down": gguf.GGMLQuantizationType.Q2_K, "attn_output": gguf.GGMLQuantizationType.Q4_K}
    writer = gguf.GGUFWriter(tmp_path / "model.gguf", "llama")
    writer.add_block_count(1)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    rng = np.random.default_rng(0)
    for name, qtype in types.items():
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, size=(256, 256 // block_size * type_size), dtype=np.uint8)
        writer.add_tensor(f"blk.0.{name}.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with caplog.at_level(logging.INFO, logger="services.worker.gguf_weights"):
        weights = GGUFWeights(tmp_path / "model.gguf")
    lines = [r.getMessage() for r in caplog.records if "dequantized" in r.getMessage()]
    assert len(lines) == 1 and "Q2_K, Q3_K weights dequantized to float32" in lines[0], lines
    assert weights.blocks("model.layers.0.self_attn.q_proj.weight") is None
    assert weights.blocks("model.layers.0.mlp.down_proj.weight") is None
    assert weights.blocks("model.layers.0.self_attn.o_proj.weight").qtype is QuantType.Q4_K
