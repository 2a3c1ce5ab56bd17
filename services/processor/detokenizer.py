"""Incremental detokenization: one choice's output token ids in, text deltas out.

The contract: the deltas of a stream, `flush()` included, concatenate to exactly
`tokenizer.decode(output_ids, skip_special_tokens=...)`. The text is that of the output alone, the
prompt does not change it, so a streamed answer equals the non-streamed one token for token.

The technique is vLLM's prefix/read offsets. A token may carry only part of a character (GPT-2
byte-level BPE splits an emoji over several tokens; SentencePiece byte-fallback spells a rare
character as `<0xE6><0x97><0xA5>`); decoding it alone gives U+FFFD. So each step decodes a short
window of ids and emits what the window adds, unless the window's text ends in U+FFFD, in which case
the text is held back until a later token completes the character:

    ids:     ... | emitted before | emitted last step | new, not yet emitted |
                                  ^prefix_offset      ^read_offset          ^len(ids)
    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])
    delta       = new_text[len(prefix_text):]   (held back while new_text ends in U+FFFD)

Both decodes start at the same id, so decoder steps that look at the start of a string (the
SentencePiece decoders strip the first space) act alike on both and cancel out in the difference.
A window only moves to where the text did not end in U+FFFD, that is, to a character boundary, so
its decode equals that stretch of the one-shot decode. Per token this costs a decode of a few ids,
not of the whole output.

Limit: byte-fallback decoders decide a run of byte tokens as a whole (a run that is not valid UTF-8
becomes one U+FFFD per byte), so a model that spells invalid UTF-8 with byte tokens can change text
already streamed; the stream then differs from the one-shot decode inside that garbage only.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one choice's output token ids into text deltas; see the module docstring.

    `prompt_token_ids` is accepted for parity with vLLM's detokenizer and is deliberately not used:
    priming the window with the prompt would make the text differ from the one-shot decode of the
    output (a SentencePiece tokenizer would keep the first token's leading space).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # A fast tokenizer decodes in Rust without per-call Python overhead; transformers'
        # `decode` adds nothing to it for us (it ignores spaces_between_special_tokens on fast
        # tokenizers, and clean-up of tokenization spaces is a WordPiece-era option we keep off).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self.token_ids: list[int] = []
        self.output_text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(token_ids[_prefix_offset:_read_offset])

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Appends `new_token_ids` and returns the text they complete (possibly "")."""
        delta = []
        for token_id in new_token_ids:
            self.token_ids.append(int(token_id))
            delta.append(self._step())
        text = "".join(delta)
        self.output_text += text
        return text

    def flush(self) -> str:
        """Returns the text still held back, at the end of the output: an incomplete character
        at the end of the output can no longer be completed and is emitted as the decoder spells it.
        """
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        text = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset = len(self.token_ids)
        self._prefix_text = ""
        self.output_text += text
        return text

    def _step(self) -> str:
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            clean_up_tokenization_spaces=False,
        )
