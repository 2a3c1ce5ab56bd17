"""Stop strings, matched on the text as it streams.

Stops are split (engine-pitfalls 6): EOS, stop token ids and length end a request in the engine;
stop strings are matched here, in the processor, which then aborts the engine request.

A stop string may be split over any number of deltas, so the last `max(len(stop)) - 1` characters
are held back while streaming: a match that is completed by a later delta starts at most that far
back, so text before the held tail can never become part of one and is safe to emit.

    text seen:  | emitted | held (max_len - 1) | new delta |
                                   a match that ends in the new delta starts here or later ^

Which stop wins: the one that completes first, i.e. whose match ends earliest in the text (on a tie,
the longer one, which starts earlier). This is what a character-by-character stream would do, so the
result does not depend on how the text was cut into deltas.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class _Match(NamedTuple):
    end: int  # index just past the match in the buffer
    start: int
    stop: str


class StopStringMatcher:
    """Cuts one choice's text at its first stop string; fed text deltas, returns what is safe to emit."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        if isinstance(stop, str):
            raise TypeError("stop must be a sequence of strings, not a string")
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self._buffer = ""  # text fed but not yet emitted: at most _holdback chars between calls
        self.stop_reason: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def feed(self, delta: str, check: bool = True) -> tuple[str, bool]:
        """Adds `delta` and returns (text safe to emit now, stopped).

        `check=False` looks for no stop string in `delta` (before `min_tokens` outputs, vLLM does
        not check stop strings) but still holds back, so a stop that starts in this text and ends in a
        later checked delta is found. Once stopped, every later call returns ("", True).
        """
        if self.stopped:
            return "", True
        new_start = len(self._buffer)
        self._buffer += delta
        match = self._find(new_start) if check else None
        if match is not None:
            self.stop_reason = match.stop
            cut = match.end if self.include_stop_str_in_output else match.start
            out = self._buffer[:cut]
            self._buffer = ""
            return out, True
        keep = min(self._holdback, len(self._buffer))
        out = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(self._buffer) - keep :]
        return out, False

    def flush(self) -> str:
        """Returns the held-back text when the output ends without a stop string."""
        out, self._buffer = self._buffer, ""
        return out

    def _find(self, new_start: int) -> _Match | None:
        """The stop whose first match ending inside the new text (at or after `new_start`) ends earliest."""
        best: _Match | None = None
        for stop in self.stop:
            # A match ending at or after new_start starts at or after new_start - len(stop) + 1.
            start = self._buffer.find(stop, max(0, new_start - len(stop) + 1))
            if start == -1:
                continue
            candidate = _Match(start + len(stop), start, stop)
            if best is None or (candidate.end, candidate.start) < (best.end, best.start):
                best = candidate
        return best
