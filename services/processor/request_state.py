"""One OpenAI-level request between the processor and the engine: its choices' engine requests,
and their engine outputs folded into the deltas the caller sees. The one output path: the
processor service (AsyncProcessor, over engine streams) and the offline `LLM` (over
`EngineCore.step()`) both drive this class.

    RequestState(processor, request)          tokenize, validate, one engine request per choice
    .apply(index, engine_output) -> ChoiceDelta | None     detokenize, stop strings, logprobs' texts
    .delta(choice_deltas, engine_outputs) -> GenerateDelta   usage so far, prompt (first), prompt logprobs
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.clients import ChoiceDelta, GenerateDelta, GenerateRequest
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.model_runner_output import TokenLogprobs
from services.processor.beam_search import check_beam_search
from services.processor.output_processor import FINISH_STOP, RequestOutputState
from services.processor.processor import Processor

FINISH_ERROR = "error"


@dataclass(slots=True)
class Choice:
    index: int
    request: EngineCoreRequest
    state: RequestOutputState
    num_cached_tokens: int = 0
    finished: bool = False  # as far as this request is concerned (the engine may not know yet)
    # A stop string ended it here: the engine request must be aborted (the engine does not know).
    stopped_by_string: bool = False


class RequestState:
    def __init__(self, processor: Processor, request: GenerateRequest) -> None:
        """ValueError for invalid input, before any engine request exists."""
        assert not request.use_beam_search, "beam search runs in services/processor/beam_search.py"
        check_beam_search(request)
        self.processor = processor
        self.request = request
        self.prompt_token_ids = processor.prompt_of(request)
        engine_requests = processor.make_requests(request.request_id, self.prompt_token_ids, request.params,
                                                  request.priority, request.cache_salt, request.group_id,
                                                  request.session_id, request.tenant_id, request.lora_name)
        self.choices = [Choice(i, r, processor.output_state(self.prompt_token_ids, r.sampling_params))
                        for i, r in enumerate(engine_requests)]
        self._first = True
        # Every choice's engine request computes the prompt logprobs; the first to arrive are sent.
        self._prompt_logprobs_sent = request.params.prompt_logprobs is None

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)

    def running_ids(self) -> list[str]:
        """The engine requests of choices not finished yet (to abort when the caller goes away)."""
        return [c.request.request_id for c in self.choices if not c.finished]

    def apply(self, index: int, out: EngineCoreOutput) -> ChoiceDelta | None:
        """Choice `index`'s delta for one engine output; None for an output that arrived after the
        choice finished here (the engine sent it before it saw our abort)."""
        choice = self.choices[index]
        if choice.finished:
            return None
        if out.finish_reason == FINISH_ERROR:
            raise RuntimeError(f"the engine failed request {out.request_id}")
        if choice.state.num_output_tokens == 0:
            choice.num_cached_tokens = out.num_cached_tokens
        text = choice.state.process(out.new_token_ids, out.finished, out.finish_reason, out.stop_reason,
                                    drop_last_token=out.finish_reason == FINISH_STOP and bool(out.new_token_ids))
        choice.finished = text.finished
        choice.stopped_by_string = text.abort_engine
        logprobs = list(out.new_logprobs) if choice.request.sampling_params.num_logprobs is not None else []
        decode = self.processor.decode_token
        return ChoiceDelta(
            index=index,
            text=text.text,
            token_ids=list(out.new_token_ids),
            logprobs=logprobs,
            finish_reason=text.finish_reason,
            stop_reason=text.stop_reason,
            logprob_tokens=[[decode(t) for t in lp.token_ids] for lp in logprobs],
        )

    def delta(self, choice_deltas: list[ChoiceDelta], outputs: Sequence[EngineCoreOutput]) -> GenerateDelta:
        """The delta of one batch of engine outputs (`outputs`, whose choices' deltas are
        `choice_deltas`): the prompt with the first, usage counters cumulative."""
        delta = GenerateDelta(
            choices=choice_deltas,
            prompt_token_ids=list(self.prompt_token_ids) if self._first else None,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=max(c.num_cached_tokens for c in self.choices),
            num_generated_tokens=sum(c.state.num_output_tokens for c in self.choices),
            prompt_text=(self.processor.prompt_text(self.request, self.prompt_token_ids)
                         if self._first and self.request.echo else None),
        )
        prompt_logprobs = next((out.new_prompt_logprobs for out in outputs if out.new_prompt_logprobs), None)
        if prompt_logprobs is None and len(self.prompt_token_ids) == 1:
            prompt_logprobs = []  # a one-token prompt has nothing to score: its first token's None only
        if not self._prompt_logprobs_sent and prompt_logprobs is not None:
            self._add_prompt_logprobs(delta, prompt_logprobs)
            self._prompt_logprobs_sent = True
        self._first = False
        return delta

    def _add_prompt_logprobs(self, delta: GenerateDelta, logprobs: list[TokenLogprobs]) -> None:
        """Entry i is about prompt token i + 1: the first prompt token has none."""
        prompt = self.prompt_token_ids
        assert len(logprobs) == len(prompt) - 1, (len(logprobs), len(prompt))
        decode = self.processor.decode_token
        delta.prompt_logprobs = [None, *logprobs]
        delta.prompt_logprob_tokens = [[decode(prompt[0])], *([decode(t) for t in lp.token_ids] for lp in logprobs)]
