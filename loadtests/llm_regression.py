"""A quick before/after check of the offline `LLM` path: 64 short prompts x 32 greedy tokens (EOS
ignored), best of three runs, printed as output tok/s with a label.

    PYTHONPATH=<checkout> .venv/bin/python -m loadtests.llm_regression <label>   # run from <checkout>
"""

import sys, time
from services import LLM, SamplingParams
llm = LLM(model="smollm2", kv_cache_memory=512 * 2**20, max_num_seqs=64)
prompts = [f"Story number {i}: once upon a time" for i in range(64)]
params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
llm.generate(prompts[:2], params)
best = 1e9
for _ in range(3):
    t = time.perf_counter(); out = llm.generate(prompts, params); best = min(best, time.perf_counter() - t)
    assert all(len(o.outputs[0].token_ids) == 32 for o in out)
print(sys.argv[1], f"{64*32/best:.1f} tok/s")
