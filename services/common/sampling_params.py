"""Per-request sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.structured_outputs import StructuredOutputs

# Below this temperature sampling is greedy (and top-k/top-p/min-p are off), as in vLLM.
GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20  # the gateway's default limit (--max-logprobs), as vLLM's
WHOLE_VOCABULARY = -1  # logprobs / prompt_logprobs: every token's (vLLM's -1), resolved by the processor
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: a bias of +-100 already forces or bans a token
# Entries of any token-id list, counted before duplicates go: more than any vocabulary has, so a
# longer list repeats ids. The gateway's own limits (--max-allowed-token-ids, ...) are lower.
MAX_TOKEN_IDS = 1 << 18
TOKEN_ID_LISTS = ("allowed_token_ids", "logit_bias", "stop_token_ids", "logprob_token_ids")
REALS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # each id once, in the order given
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N per output token, plus the sampled one; -1: the whole vocabulary
    prompt_logprobs: int | None = None  # the same for each prompt token
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # Only these tokens may be sampled (vLLM's allowed_token_ids); None: every token. Never empty;
    # sorted, each id once.
    allowed_token_ids: tuple[int, ...] | None = None
    # The logprobs of exactly these tokens (after the sampled one's) at each output position, in place of
    # the top-N (vLLM's logprob_token_ids); `logprobs`, if set too, must be their number.
    logprob_token_ids: tuple[int, ...] | None = None
    # A request migrated from an engine that died (services/processor/migration.py): the last this
    # many prompt tokens are its own earlier outputs, which frequency and presence penalties count as
    # outputs. max_tokens and min_tokens are then what is left of the original ones. 0 for every other.
    num_resumed_outputs: int = 0
    # The output's constraint (a JSON schema, regex, choice or grammar); None: unconstrained. The engine
    # masks every token the constraint forbids and ends the request once the constraint is complete.
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        # First, and in O(1): a list from the wire (a protobuf container) is copied only once it passes.
        for name in TOKEN_ID_LISTS:
            value = getattr(self, name)
            if value is not None and len(value) > MAX_TOKEN_IDS:
                raise ValueError(f"{name} has {len(value)} token ids; at most {MAX_TOKEN_IDS}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        # Each id once: a list of duplicates costs every service that reads it, and means no more.
        object.__setattr__(self, "stop_token_ids", tuple(dict.fromkeys(self.stop_token_ids)))
        if self.allowed_token_ids is not None:  # a set: sorted, so that equal sets compare equal
            object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(self.allowed_token_ids))))
        if self.logprob_token_ids is not None:  # columns of the answer, in the order asked: kept as sent
            object.__setattr__(self, "logprob_token_ids", tuple(self.logprob_token_ids))
        if self.logit_bias is not None:  # a copy: the caller's dict (or protobuf map) may change
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self._validate()

    def _validate(self) -> None:
        # NaN passes every comparison below (and poisons every logit it touches): finite first.
        for name in REALS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.num_resumed_outputs < 0:
            raise ValueError(f"num_resumed_outputs must be non-negative, got {self.num_resumed_outputs}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < WHOLE_VOCABULARY:
                raise ValueError(f"{name} must be non-negative, or -1 for the whole vocabulary, got {value}")
        self._validate_token_lists()
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for token_id, bias in (self.logit_bias or {}).items():
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # False for NaN
                raise ValueError(f"logit_bias of token {token_id} must be in [-{MAX_LOGIT_BIAS:g}, "
                                 f"{MAX_LOGIT_BIAS:g}], got {bias}")

    def _validate_token_lists(self) -> None:
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty if given (nothing could be sampled)")
        ids = self.logprob_token_ids
        if ids is None:
            return
        if not 1 <= len(ids) <= MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(f"logprob_token_ids must list 1 to {MAX_LOGPROB_TOKEN_IDS} token ids, got {len(ids)}")
        if self.logprobs is not None and self.logprobs != len(ids):
            raise ValueError(f"logprobs ({self.logprobs}) must equal the number of logprob_token_ids ({len(ids)}) "
                             "when both are set")

    @property
    def num_logprobs(self) -> int | None:
        """Logprobs per output token after the sampled one's: the top-N, or the explicit ids'; None: none."""
        if self.logprob_token_ids is not None:
            return len(self.logprob_token_ids)
        return self.logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        return frozenset(self.stop_token_ids)


@dataclass(frozen=True)
class BeamSearchParams:
    """The offline `LLM.beam_search`'s parameters, with vLLM's names and defaults. Beam search is
    deterministic: `temperature` is taken for vLLM's sake and changes nothing (the beams are scored
    by the model's own logprobs)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def sampling_params(self) -> SamplingParams:
        """What a beam search request carries as its SamplingParams: n is the beam width."""
        return SamplingParams(n=self.beam_width, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos,
                              temperature=self.temperature,
                              include_stop_str_in_output=self.include_stop_str_in_output)
