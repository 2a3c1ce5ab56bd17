"""How far weight-only int8 (`--quantization int8`: every 2-D weight in Q8_0 blocks, quantized at
load) moves the default model from Hugging Face transformers' float32 one, over the HF-equivalence
prompts (tests/model/prompts.py: 13 chats and 12 raw texts, 1 to ~1,500 tokens), 64 greedy tokens each.

Teacher forcing, as tests/model/hf_reference.py does: one float32 HF forward over prompt + our
tokens gives the reference's distribution at each of our positions.

    top-1 agreement      share of our greedy tokens that are the reference's argmax given our prefix
    identical sequences  prompts whose 64 tokens are all the reference's argmax (= HF greedy output)
    logprob error        |ours - reference| over our top-5 logprobs at every position: mean, p99, max

Run from the repository root (a few minutes on 2 cores):

    .venv/bin/python -m loadtests.int8_agreement
    .venv/bin/python -m loadtests.int8_agreement --quantization gguf --model smollm2   # the exact path
    .venv/bin/python -m loadtests.int8_agreement --quantization gguf --model smollm2 --dtype auto  # bf16 or int8 steps
    .venv/bin/python -m loadtests.int8_agreement --quantization gguf --model gemma3-270m --dtype auto
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from services import LLM, SamplingParams
from services.processor.tokenizer import apply_chat_template
from services.worker.loader import resolve_model
from tests.model.prompts import conversations, raw_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="int8")
    parser.add_argument("--dtype", default="float32",
                        help="auto: a GGUF model's larger steps in bfloat16, or against int8 activations (AVX2), as the CPU has")
    parser.add_argument("--model", default=None, help="default: the converted float32 folder of smollm2")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    folder = resolve_model(args.model or "smollm2")  # the float32 reference (a GGUF model's converted folder)
    llm = LLM(model=args.model or str(folder), quantization=args.quantization, kv_cache_memory=256 * 2**20,
              dtype=args.dtype)
    tokenizer = llm.get_tokenizer()
    # a base model without a chat template gets the raw texts only
    prompts = [apply_chat_template(tokenizer, c) for c in conversations()] if tokenizer.chat_template else []
    prompts += [tokenizer.encode(p) for p in raw_prompts()]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=5))
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    agree = positions = identical = 0
    errors: list[float] = []
    for prompt, output in zip(prompts, outputs):
        ours = output.outputs[0]
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + ours.token_ids])).logits[0]
        reference = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(ours.token_ids) - 1].float(), -1)
        matches = reference.argmax(-1) == torch.tensor(ours.token_ids)
        agree += int(matches.sum())
        positions += len(ours.token_ids)
        identical += bool(matches.all())
        for i, top in enumerate(ours.logprobs):
            errors.extend(abs(lp.logprob - reference[i, token].item()) for token, lp in top.items())
    err = torch.tensor(errors)
    print(f"--quantization {args.quantization}: {len(prompts)} prompts, {positions} positions")
    print(f"top-1 agreement {agree / positions:.4f} ({agree}/{positions}); "
          f"identical sequences {identical}/{len(prompts)}")
    print(f"logprob error (top-5): mean {err.mean():.4f}, p99 {err.quantile(0.99):.4f}, max {err.max():.4f}")


if __name__ == "__main__":
    main()
