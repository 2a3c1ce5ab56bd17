"""The offline API: the processor, engine and worker cores wired together in one process.

    from services import LLM, SamplingParams
    llm = LLM(model="smollm2")
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16, temperature=0))
    print(outputs[0].outputs[0].text)

LoRA adapters as vLLM's: `LLM(model, enable_lora=True, max_loras=2, max_lora_rank=16)`, then
`llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))` (one for all
prompts, or one per prompt, None for the base model); an adapter is loaded when first named.
"""

from __future__ import annotations

import atexit
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from services.common.clients import GenerateDelta, GenerateRequest
from services.common.config import EngineArgs
from services.common.lora import LoRARequest
from services.common.model_runner_output import TokenLogprobs
from services.common.engine_output import EngineCoreOutput
from services.common.sampling_params import BeamSearchParams, SamplingParams
from services.inprocess import OfflineStack
from services.processor.beam_search import BeamSearch
from services.processor.processor import Prompt
from services.processor.request_state import RequestState

Message = Mapping[str, Any]
LoRARequests = LoRARequest | Sequence[LoRARequest | None] | None


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


class LLM:
    """The offline API: `generate` and `chat` run a batch to completion on the in-process stack
    (services/inprocess.py), stepping the engine in the caller's thread; prompts, engine requests
    and outputs go through the processor's RequestState, as in the processor service.

    Keyword arguments are the flags' names (`LLM(model="smollm2", max_num_seqs=8,
    kv_cache_memory=2**28, scheduling_policy="priority")`; services/common/config.py). The waiting
    queue is unbounded here: a batch is queued whole.

    `tensor_parallel_size=N` above 1 runs the model on N worker processes (ranks of one
    torch.distributed group, services/engine/worker_processes.py), stopped by close(), by leaving
    a `with LLM(...)` block, or at interpreter exit; with 1 (the default) all is in this process.
    """

    def __init__(self, model: str = "smollm2", **kwargs: Any) -> None:
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.args = replace(args, scheduler=replace(args.scheduler, max_num_waiting=None))
        self.worker, self.engine, self.processor, self._worker_processes = OfflineStack.create(self.args)
        if self._worker_processes is not None:
            atexit.register(self.close)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the worker processes, if any (idempotent). An in-process worker needs nothing."""
        if self._worker_processes is not None:
            atexit.unregister(self.close)
            self._worker_processes.close()
            self._worker_processes = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def get_tokenizer(self):
        return self.processor.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequests = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); outputs in prompt order.
        `lora_request`: the LoRA adapter of every prompt, or one per prompt (None: the base model)."""
        return self._run(self._prompt_requests(prompts, sampling_params, priority, lora_request))

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequests = None,
    ) -> list[RequestOutput]:
        """Beam search for each prompt (services/processor/beam_search.py), every prompt's beams
        stepped together in one batch; each output's `beam_width` completions best first, with their
        cumulative logprobs."""
        requests = self._prompt_requests(prompts, params.sampling_params(), None, lora_request)
        for r in requests:
            r.use_beam_search, r.length_penalty = True, params.length_penalty
        searches = [BeamSearch(self.processor, r) for r in requests]  # all validated before any runs
        running: set[str] = set()
        try:
            while live := [s for s in searches if not s.finished]:
                steps = [s.step_requests() for s in live]
                for request in itertools.chain.from_iterable(steps):
                    self.engine.add_request(request)
                    running.add(request.request_id)
                outputs: dict[str, EngineCoreOutput] = {}
                while running:
                    for out in self.engine.step():
                        if out.finished and out.request_id in running:
                            running.discard(out.request_id)
                            outputs[out.request_id] = out
                for search, step in zip(live, steps):
                    search.advance([outputs[r.request_id] for r in step])
        finally:
            if running:
                self.engine.abort_requests(list(running))
            self.flush()
        return [_beam_output(r, s) for r, s in zip(requests, searches)]

    def _prompt_requests(self, prompts: Prompt | Sequence[Prompt],
                         sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                         priority: Sequence[int] | None, lora_request: LoRARequests) -> list[GenerateRequest]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = self._params_list(sampling_params, len(prompts))
        loras = self._lora_names(lora_request, len(prompts))
        return [
            GenerateRequest(str(next(self._ids)), p, prompt=prompt if isinstance(prompt, str) else None,
                            prompt_token_ids=None if isinstance(prompt, str) else list(prompt),
                            priority=priority[i] if priority else 0, lora_name=lora)
            for i, (prompt, p, lora) in enumerate(zip(prompts, params, loras))
        ]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora_request: LoRARequests = None,
    ) -> list[RequestOutput]:
        """Generate for one conversation or a list of them, with the model's own chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        params = self._params_list(sampling_params, len(conversations))
        loras = self._lora_names(lora_request, len(conversations))
        return self._run([
            GenerateRequest(str(next(self._ids)), p, messages=list(c), add_generation_prompt=add_generation_prompt,
                            continue_final_message=continue_final_message,
                            chat_template_kwargs=dict(chat_template_kwargs or {}), lora_name=lora)
            for c, p, lora in zip(conversations, params, loras)
        ])

    def _lora_names(self, lora_request: LoRARequests, count: int) -> list[str | None]:
        """Each prompt's adapter name, every adapter registered with the engine on first use (its
        worker loads it from its folder then)."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * count
        elif len(lora_request) != count:
            raise ValueError(f"{len(lora_request)} LoRA requests for {count} prompts")
        else:
            loras = list(lora_request)
        for lora in {lora for lora in loras if lora is not None}:
            if self.engine.loras is None:
                raise ValueError("a lora_request needs LLM(..., enable_lora=True)")
            self.engine.loras.add(lora)
        return [None if lora is None else lora.lora_name for lora in loras]

    @staticmethod
    def _params_list(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                     count: int) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or SamplingParams()] * count
        if len(sampling_params) != count:
            raise ValueError(f"{len(sampling_params)} sampling params for {count} prompts")
        return list(sampling_params)

    def _run(self, requests: list[GenerateRequest]) -> list[RequestOutput]:
        states = [RequestState(self.processor, r) for r in requests]  # all validated before any runs
        results = [RequestOutput(r.request_id, r.prompt, s.prompt_token_ids,
                                 [CompletionOutput(c.index) for c in s.choices]) for r, s in zip(requests, states)]
        # engine request id -> (its request's state, output, the choice's index)
        running: dict[str, tuple[RequestState, RequestOutput, int]] = {}
        try:
            for state, result in zip(states, results):
                for choice in state.choices:
                    self.engine.add_request(choice.request)
                    running[choice.request.request_id] = (state, result, choice.index)
            while running:
                for out in self.engine.step():
                    if out.request_id not in running:
                        continue
                    state, result, index = running[out.request_id]
                    delta = state.apply(index, out)
                    if delta is not None:
                        _fold(result, state.delta([delta], [out]))
                    if state.choices[index].finished:
                        del running[out.request_id]
                        if state.choices[index].stopped_by_string:
                            self.engine.abort_requests([out.request_id])
        finally:
            # Leave nothing behind when interrupted: abort what is still running.
            if running:
                self.engine.abort_requests(list(running))
            self.flush()
        return results

    def flush(self) -> None:
        """Run an empty step so the worker drops the state of requests that just finished."""
        if self.engine.has_finished_requests() and not self.engine.has_unfinished_requests():
            self.engine.step()


def _beam_output(request: GenerateRequest, search: BeamSearch) -> RequestOutput:
    """A finished search's answer: its choices best first, each with its cumulative logprob."""
    result = RequestOutput(request.request_id, request.prompt, search.prompt_token_ids,
                           [CompletionOutput(i) for i in range(search.width)])
    _fold(result, search.result())
    for completion, beam in zip(result.outputs, search.best()):
        completion.cumulative_logprob = beam.cumulative_logprob
    return result


def _fold(result: RequestOutput, delta: GenerateDelta) -> None:
    """Add one delta to the output the caller gets."""
    result.num_cached_tokens = delta.num_cached_tokens
    if delta.prompt_logprobs:
        result.prompt_logprobs = [None if lp is None else _logprob_dict(lp, tokens)
                                  for lp, tokens in zip(delta.prompt_logprobs, delta.prompt_logprob_tokens)]
    for choice in delta.choices:
        completion = result.outputs[choice.index]
        completion.text += choice.text
        completion.token_ids.extend(choice.token_ids)
        if choice.logprobs:
            if completion.logprobs is None:
                completion.logprobs, completion.cumulative_logprob = [], 0.0
            for lp, tokens in zip(choice.logprobs, choice.logprob_tokens):
                completion.logprobs.append(_logprob_dict(lp, tokens))
                completion.cumulative_logprob += lp.logprobs[0]
        if choice.finish_reason is not None:
            completion.finish_reason = choice.finish_reason
            completion.stop_reason = choice.stop_reason


def _logprob_dict(lp: TokenLogprobs, tokens: Sequence[str]) -> dict[int, Logprob]:
    """The sampled token first (with its rank), then the top ones (rank = position)."""
    entries: dict[int, Logprob] = {}
    for i, (token_id, logprob, text) in enumerate(zip(lp.token_ids, lp.logprobs, tokens)):
        if token_id not in entries:
            entries[token_id] = Logprob(logprob, lp.rank if i == 0 else i, text)
    return entries
