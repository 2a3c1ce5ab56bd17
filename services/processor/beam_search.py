"""Beam search above the engine, as vLLM runs it: each step sends every live beam to the engine as
a one-token greedy request asking for the top 2 x width logprobs, and keeps the best continuations.

    BeamSearch(processor, request)        tokenize and validate; one live beam (the prompt)
    .step_requests() -> [EngineCoreRequest]    one per live beam: prompt + beam, max_tokens 1
    .advance(outputs)                     score the candidates; EOS ones finish, the best `width` live on
    .finished / .result() -> GenerateDelta    after max_tokens steps: the `width` best, best first

A beam's request repeats the prompt and the beam's tokens, so the engine's prefix cache serves
every full block computed before (the prompt's, and the blocks beams inherited from their parent):
a step computes at most one block per beam. Both drivers run a step's requests as one batch: the
processor service over engine streams (AsyncProcessor), the offline `LLM` over `EngineCore.step()`.

Scores follow vLLM: the cumulative logprob over (prompt + output length, an EOS not counted) **
length_penalty. A candidate ending in EOS (unless ignore_eos) finishes, whatever its rank among the
step's candidates, and the search runs max_tokens steps with no early stop. Sampling is fixed
(greedy, the model's own logprobs): every sampling parameter that would change it is refused.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import NamedTuple

from services.common.clients import ChoiceDelta, GenerateDelta, GenerateRequest
from services.common.engine_output import EngineCoreOutput, EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.processor.processor import Processor

MAX_BEAM_WIDTH = 32  # each step asks for 2 x width logprobs of width requests
# length ** length_penalty stays a finite, non-zero float for any length up to 2**20 tokens.
MAX_LENGTH_PENALTY = 32
# What a beam search request may set besides n, max_tokens, ignore_eos, include_stop_str_in_output,
# temperature (no effect: the logprobs are the model's own) and how the text is detokenized.
FIXED = SamplingParams()
REFUSED = ("top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "logit_bias", "min_tokens", "stop", "stop_token_ids", "logprobs", "prompt_logprobs", "allowed_token_ids",
           "logprob_token_ids", "structured_outputs")
FINISH_STOP, FINISH_LENGTH = "stop", "length"


@dataclass(slots=True)
class Beam:
    token_ids: list[int] = field(default_factory=list)  # output tokens, a final EOS included
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | None = None  # the EOS id that ended it


class Candidate(NamedTuple):
    cumulative_logprob: float
    beam: int  # index of its parent in the live beams
    token_id: int


def check_beam_search(request: GenerateRequest) -> None:
    """ValueError for a request beam search cannot answer as asked."""
    params = request.params
    if not request.use_beam_search:
        if request.length_penalty != 1.0:
            raise ValueError("length_penalty weighs beam search only: set use_beam_search too")
        return
    if not -MAX_LENGTH_PENALTY <= request.length_penalty <= MAX_LENGTH_PENALTY:  # False for NaN too
        raise ValueError(f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], "
                         f"got {request.length_penalty}")
    if not 1 <= params.n <= MAX_BEAM_WIDTH:
        raise ValueError(f"n is the beam width with use_beam_search: at most {MAX_BEAM_WIDTH}, got {params.n}")
    asked = [name for name in REFUSED if getattr(params, name) != getattr(FIXED, name)]
    if asked:
        raise ValueError(f"use_beam_search takes n, max_tokens, length_penalty, ignore_eos and "
                         f"include_stop_str_in_output; it does not support {', '.join(asked)}")


class BeamSearch:
    def __init__(self, processor: Processor, request: GenerateRequest) -> None:
        """ValueError for invalid input, before any engine request exists."""
        assert request.use_beam_search
        check_beam_search(request)
        self.processor = processor
        self.request = request
        self.prompt_token_ids = processor.prompt_of(request)
        params = request.params
        self.width = params.n
        room = processor.max_model_len - len(self.prompt_token_ids)
        self.max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.eos_token_ids = frozenset(() if params.ignore_eos else processor.info.eos_token_ids)
        self.step_params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2 * self.width)
        # Validates the prompt once (length, vocabulary) as every step's requests would.
        processor.make_requests(request.request_id, self.prompt_token_ids, self.step_params)
        self.live = [Beam()]
        self.done: list[Beam] = []
        self.num_steps = 0
        self.num_cached_tokens = 0  # the first step's: how much of the prompt the cache held

    @property
    def finished(self) -> bool:
        return self.num_steps >= self.max_tokens or not self.live

    def step_requests(self) -> list[EngineCoreRequest]:
        """This step's engine requests, one per live beam, in the order of `live`."""
        r = self.request
        return [
            self.processor.make_requests(f"{r.request_id}-s{self.num_steps}-b{i}",
                                         [*self.prompt_token_ids, *beam.token_ids], self.step_params, r.priority,
                                         r.cache_salt, r.group_id or r.request_id, r.session_id, r.tenant_id,
                                         r.lora_name)[0]
            for i, beam in enumerate(self.live)
        ]

    def advance(self, outputs: list[EngineCoreOutput]) -> None:
        """Takes this step's outputs (the order of step_requests()): every live beam's top 2 x width
        continuations compete; those ending in EOS join the finished, the best `width` others live on."""
        assert len(outputs) == len(self.live) and not self.finished
        candidates: list[Candidate] = []
        for i, (beam, out) in enumerate(zip(self.live, outputs)):
            if out.finish_reason == "error" or not out.new_logprobs:
                raise RuntimeError(f"the engine failed request {out.request_id}")
            if self.num_steps == 0:
                self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
            top = out.new_logprobs[0]  # column 0 is the sampled token, repeated among the top ones
            for token_id, logprob in zip(top.token_ids[1:], top.logprobs[1:]):
                candidates.append(Candidate(beam.cumulative_logprob + logprob, i, token_id))
        live: list[Candidate] = []
        for c in candidates:
            if c.token_id in self.eos_token_ids:
                self.done.append(self._child(c, FINISH_STOP))
            else:
                live.append(c)
        self.num_steps += 1
        self.live = [self._child(c) for c in heapq.nlargest(self.width, live)]

    def _child(self, c: Candidate, finish_reason: str | None = None) -> Beam:
        parent = self.live[c.beam]
        stop_reason = c.token_id if finish_reason == FINISH_STOP else None
        return Beam([*parent.token_ids, c.token_id], c.cumulative_logprob, finish_reason, stop_reason)

    def score(self, beam: Beam) -> float:
        """vLLM's: the prompt counts in the length, a final EOS does not."""
        length = len(self.prompt_token_ids) + len(beam.token_ids) - (beam.finish_reason == FINISH_STOP)
        return beam.cumulative_logprob / length ** self.request.length_penalty

    def best(self) -> list[Beam]:
        """The `width` best of the finished and the live beams, best first (a stable order for ties)."""
        return sorted(self.done + self.live, key=self.score, reverse=True)[:self.width]

    def result(self) -> GenerateDelta:
        """The one delta of the whole answer: every choice, finished, best first."""
        params = self.request.params
        choices = []
        for index, beam in enumerate(self.best()):
            stopped = beam.finish_reason == FINISH_STOP
            text_ids = beam.token_ids[:-1] if stopped else beam.token_ids
            token_ids = beam.token_ids if not stopped or params.include_stop_str_in_output else text_ids
            text = self.processor.tokenizer.decode(
                text_ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens)
            choices.append(ChoiceDelta(index, text, token_ids, finish_reason=beam.finish_reason or FINISH_LENGTH,
                                       stop_reason=beam.stop_reason))
        return GenerateDelta(
            choices=choices,
            prompt_token_ids=list(self.prompt_token_ids),
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens,
            num_generated_tokens=sum(len(c.token_ids) for c in choices),
            prompt_text=self.processor.prompt_text(self.request, self.prompt_token_ids) if self.request.echo else None,
        )

