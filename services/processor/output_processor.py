"""One choice's engine outputs (token ids, finish) turned into text deltas, stop strings applied."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from transformers import PreTrainedTokenizerBase

from services.common.sampling_params import SamplingParams
from services.processor.detokenizer import IncrementalDetokenizer
from services.processor.stop_checker import StopStringMatcher

FINISH_STOP = "stop"


class TextDelta(NamedTuple):
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", ... once finished
    stop_reason: str | int | None  # the stop string, the stop token id, or None (EOS, length)
    abort_engine: bool  # a stop string ended the choice here; the engine request must be aborted


class RequestOutputState:
    """Detokenizer + stop strings for one choice of one request.

    The engine ends a choice on EOS, a stop token id or length; this object ends it on a stop string,
    which the engine does not know about: the delta that reports it has `abort_engine=True`. After a
    finished delta the caller drops this object; outputs the engine sent before it saw the abort are
    ignored (as vLLM's OutputProcessor ignores outputs of requests it no longer tracks).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
    ) -> None:
        self.detokenizer = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )
        self.stop_matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self.min_tokens = params.min_tokens
        self.num_output_tokens = 0  # the engine's count, the dropped final EOS/stop token included
        self.output_text = ""  # what has been returned in deltas
        self.finished = False

    def process(
        self,
        new_token_ids: Sequence[int],
        finished: bool = False,
        finish_reason: str | None = None,
        stop_reason: int | None = None,
        drop_last_token: bool = False,
    ) -> TextDelta:
        """Takes one engine output for this choice and returns the text it adds.

        `drop_last_token`: the last id is the EOS or stop token that ended the choice in the engine
        (finish_reason "stop"); it counts as an output token but is never detokenized into the text.
        """
        assert not self.finished, "output for a choice that already finished"
        assert not drop_last_token or (finished and new_token_ids), "only a final token can be dropped"
        text_ids = new_token_ids[:-1] if drop_last_token else new_token_ids
        num_before = self.num_output_tokens
        self.num_output_tokens += len(new_token_ids)
        pieces: list[str] = []
        stopped = False
        # Token by token, so that min_tokens holds inside a multi-token output: vLLM checks stop
        # strings only once the output is longer than min_tokens.
        for i, token_id in enumerate(text_ids):
            text = self.detokenizer.update([token_id])
            out, stopped = self.stop_matcher.feed(text, check=num_before + i + 1 > self.min_tokens)
            pieces.append(out)
            if stopped:
                break
        if finished and not stopped:
            held = self.detokenizer.flush()
            out, stopped = self.stop_matcher.feed(held, check=num_before + len(text_ids) > self.min_tokens)
            pieces.append(out)
            if not stopped:
                pieces.append(self.stop_matcher.flush())
        text = "".join(pieces)
        self.output_text += text
        self.finished = finished or stopped
        if stopped:
            return TextDelta(text, True, FINISH_STOP, self.stop_matcher.stop_reason, abort_engine=not finished)
        if not finished:
            return TextDelta(text, False, None, None, abort_engine=False)
        return TextDelta(text, True, finish_reason, stop_reason, abort_engine=False)

