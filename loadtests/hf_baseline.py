"""The sequential baseline: Hugging Face transformers `generate`, one request at a time, on the same
model folder and the same chat prompts (tokenized with the same chat template as kvmesh).

Each request runs `generate(do_sample=False, max_new_tokens=L, min_new_tokens=L)`: greedy, and EOS is
suppressed until L tokens are out, so every request yields exactly L tokens (vLLM's `ignore_eos`).
Output tok/s = generated tokens / wall time over the requests that were run. One request at a time
takes long (minutes per dtype for all 128 prompts), so `--num-prompts` runs only the first K: the rate
is what matters, and it is steady from one request to the next.

    .venv/bin/python -m loadtests.hf_baseline --num-prompts 16                  # float32 and bfloat16
    .venv/bin/python -m loadtests.hf_baseline --dtype bfloat16 --num-prompts 4 --output-len 32
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import NamedTuple

import torch
import transformers
from transformers import AutoModelForCausalLM

from loadtests.chat_prompts import chat_conversations
from services.processor.tokenizer import apply_chat_template, load_tokenizer
from services.worker.loader import resolve_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class BaselineResult(NamedTuple):
    dtype: str
    num_prompts: int
    generated_tokens: int
    seconds: float
    token_ids: list[list[int]]  # the generated tokens of each request, in prompt order

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds


def load_hf_model(model_path: Path, dtype: str) -> transformers.PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype])
    return model.eval()


@torch.inference_mode()
def _generate(model: transformers.PreTrainedModel, prompt: list[int], output_len: int, pad_token_id: int) -> list[int]:
    input_ids = torch.tensor([prompt])  # [1, prompt_len]
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
        max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=pad_token_id,
    )
    return out[0, len(prompt):].tolist()


def run_baseline(model_path: Path, dtype: str, prompts: list[list[int]], output_len: int) -> BaselineResult:
    """Load the model, warm it up with a tiny generate, then time `prompts` one at a time."""
    model = load_hf_model(model_path, dtype)
    pad_token_id = model.generation_config.pad_token_id
    if pad_token_id is None:
        pad_token_id = model.generation_config.eos_token_id
    if isinstance(pad_token_id, list):
        pad_token_id = pad_token_id[0]
    _generate(model, prompts[0][:8], 4, pad_token_id)
    start = time.perf_counter()
    token_ids = [_generate(model, p, output_len, pad_token_id) for p in prompts]
    seconds = time.perf_counter() - start
    short = [i for i, t in enumerate(token_ids) if len(t) != output_len]
    if short:
        raise RuntimeError(f"HF generate returned other than {output_len} tokens for prompts {short}")
    return BaselineResult(dtype, len(prompts), sum(len(t) for t in token_ids), seconds, token_ids)


def chat_prompt_token_ids(model_path: Path, num_prompts: int) -> list[list[int]]:
    """The first `num_prompts` benchmark conversations, rendered with the model's chat template."""
    tokenizer = load_tokenizer(model_path)
    return [apply_chat_template(tokenizer, c) for c in chat_conversations(num_prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="'smollm2' or a Hugging Face model folder")
    parser.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--num-prompts", type=int, default=128, help="run only the first K chat prompts")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()

    model_path = resolve_model(args.model, None)
    prompts = chat_prompt_token_ids(model_path, args.num_prompts)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, "
          f"torch.get_num_threads() = {torch.get_num_threads()}; {len(prompts)} prompts "
          f"({sum(map(len, prompts))} prompt tokens) x {args.output_len} output tokens, one request at a time\n")
    print("| dtype | prompts | generated tokens | seconds | HF sequential tok/s |")
    print("|---|---:|---:|---:|---:|")
    for dtype in args.dtype:
        r = run_baseline(model_path, dtype, prompts, args.output_len)
        print(f"| {r.dtype} | {r.num_prompts} | {r.generated_tokens} | {r.seconds:.1f} | {r.tokens_per_s:.1f} |",
              flush=True)


if __name__ == "__main__":
    main()
