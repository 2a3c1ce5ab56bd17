"""The offline API: the processor, engine and worker cores wired together in one process.

    from services import LLM, SamplingParams
    llm = LLM(model="smollm2")
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    print(outputs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.config import CacheConfig, ModelConfig, SchedulerConfig, WorkerConfig
from services.common.engine_output import EngineCoreOutput
from services.common.model_runner_output import TokenLogprobs
from services.common.sampling_params import SamplingParams
from services.engine.engine_core import EngineCore
from services.processor.output_processor import RequestOutputState
from services.processor.processor import Processor, Prompt
from services.processor.tokenizer import TokenizerInfo, load_tokenizer
from services.worker.worker import Worker

Message = Mapping[str, Any]


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int
    decoded_token: str


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


@dataclass(slots=True)
class _Choice:
    output: RequestOutput
    completion: CompletionOutput
    state: RequestOutputState
    params: SamplingParams


class LLM:
    def __init__(
        self,
        model: str = "smollm2",
        dtype: str = "float32",
        attention_backend: str = "auto",
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 128,
        kv_cache_memory: int | None = None,
        enable_prefix_caching: bool = True,
        block_size: int = 16,
        max_model_len: int | None = None,
        scheduling_policy: str = "fcfs",
        seed: int = 0,
        cache_dir: str | Path | None = None,
    ) -> None:
        model_config = ModelConfig(model=model, dtype=dtype, max_model_len=max_model_len, seed=seed,
                                   cache_dir=Path(cache_dir) if cache_dir is not None else None)
        cache_config = CacheConfig(block_size=block_size, kv_cache_memory=kv_cache_memory,
                                   enable_prefix_caching=enable_prefix_caching)
        scheduler_config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                           max_num_seqs=max_num_seqs, policy=scheduling_policy)
        self.worker = Worker(model_config, cache_config, WorkerConfig(attention_backend=attention_backend))
        num_blocks = self.worker.determine_num_blocks()
        self.worker.initialize_cache(num_blocks, scheduler_config.max_num_seqs)
        self.engine = EngineCore(self.worker, num_blocks, self.worker.info.max_model_len,
                                 self.worker.info.model_id, cache_config, scheduler_config)
        tokenizer = load_tokenizer(self.worker.model_path)
        self.processor = Processor(tokenizer, TokenizerInfo.from_tokenizer(tokenizer, self.worker.model_path),
                                   self.engine.max_model_len)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.processor.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        token_lists = [self.processor.tokenize(p) for p in prompts]
        texts = [p if isinstance(p, str) else None for p in prompts]
        return self._run(token_lists, texts, sampling_params, priority)

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one conversation or a list of them, with the model's own chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        token_lists = [
            self.processor.tokenize_chat(c, add_generation_prompt, continue_final_message, chat_template_kwargs)
            for c in conversations
        ]
        return self._run(token_lists, [None] * len(token_lists), sampling_params, None)

    def _run(self, token_lists: list[list[int]], texts: list[str | None],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             priority: Sequence[int] | None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = ([sampling_params] * len(token_lists) if isinstance(sampling_params, SamplingParams)
                       else list(sampling_params))
        if len(params_list) != len(token_lists):
            raise ValueError(f"{len(params_list)} sampling params for {len(token_lists)} prompts")
        results: list[RequestOutput] = []
        choices: dict[str, _Choice] = {}
        try:
            for i, (tokens, text, params) in enumerate(zip(token_lists, texts, params_list)):
                request_id = str(next(self._ids))
                output = RequestOutput(request_id, text, tokens,
                                       [CompletionOutput(j) for j in range(params.n)])
                results.append(output)
                requests = self.processor.make_requests(request_id, tokens, params,
                                                        priority=priority[i] if priority else 0)
                for completion, request in zip(output.outputs, requests):
                    self.engine.add_request(request)
                    choices[request.request_id] = _Choice(
                        output, completion, self.processor.output_state(tokens, request.sampling_params),
                        params)
            while choices:
                for engine_output in self.engine.step():
                    choice = choices.get(engine_output.request_id)
                    if choice is not None and self._apply(choice, engine_output):
                        del choices[engine_output.request_id]
        finally:
            # Leave nothing behind when interrupted: abort what is still running.
            if choices:
                self.engine.abort_requests(list(choices))
            self.flush()
        return results

    def _apply(self, choice: _Choice, out: EngineCoreOutput) -> bool:
        """Fold one engine output into its choice; True when the choice is finished."""
        completion, params = choice.completion, choice.params
        if out.new_prompt_logprobs and params.prompt_logprobs is not None:
            choice.output.prompt_logprobs = [None] + [self._logprob_dict(lp) for lp in out.new_prompt_logprobs]
        if not completion.token_ids:
            choice.output.num_cached_tokens = out.num_cached_tokens
        completion.token_ids.extend(out.new_token_ids)
        if params.logprobs is not None:
            if completion.logprobs is None:
                completion.logprobs, completion.cumulative_logprob = [], 0.0
            for lp in out.new_logprobs:
                completion.logprobs.append(self._logprob_dict(lp))
                completion.cumulative_logprob += lp.logprobs[0]
        delta = choice.state.process(out.new_token_ids, out.finished, out.finish_reason, out.stop_reason,
                                     drop_last_token=out.finish_reason == "stop")
        completion.text += delta.text
        if delta.abort_engine:
            self.engine.abort_requests([out.request_id])
        if delta.finished:
            completion.finish_reason = delta.finish_reason
            completion.stop_reason = delta.stop_reason
        return delta.finished

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        entries: dict[int, Logprob] = {}
        for i, (token_id, logprob) in enumerate(zip(lp.token_ids, lp.logprobs)):
            if token_id not in entries:
                rank = lp.rank if i == 0 else i
                entries[token_id] = Logprob(logprob, rank, self.processor.decode_token(token_id))
        return entries

    def flush(self) -> None:
        """Run an empty step so the worker drops the state of requests that just finished."""
        if self.engine.scheduler.finished_req_ids and not self.engine.has_unfinished_requests():
            self.engine.step()
