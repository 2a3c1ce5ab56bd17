"""The serving benchmark's workloads: deterministic chat sessions built without downloads.

    short-chat     the 128 conversations of loadtests.chat_prompts (33-131 prompt tokens)
    long-prompt    a ~1,000-token document of its own per request, then "summarize it"
    shared-prefix  one ~500-token system prompt shared by every request + a short question each
                   (or `system_prompts` distinct ones, taken in turn)
    multi-turn     a short-chat opening (or, with `document_tokens`, a document of that length to
                   summarize: a cache miss on a later turn is then expensive), then follow-up
                   questions; each turn is sent with the whole conversation so far, the server's
                   previous answers included (so it grows)

Every workload is a list of `Session`s; a session is one request, or for multi-turn several sent one
after another. The first message of every session starts with a tag `[run R.C]`: R numbers the
benchmark runs (scenario × load) of one invocation, so a run finds nothing in the prefix cache that
an earlier run on the same server left there; C counts how often the pool of 128 prompts has been
cycled, so a repeated prompt is not a free prefix hit either. Requests of one run still share what
they would share in life (the shared-prefix system prompt, the chat template's default system
message). Token lengths are cut with the model's tokenizer, before the chat template.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from loadtests.chat_prompts import NOTES, TEMPLATES, TOPICS, Conversation, chat_conversations
from services.processor.tokenizer import apply_chat_template

SCENARIOS = ("short-chat", "long-prompt", "shared-prefix", "multi-turn")
POOL = 128  # distinct prompts per scenario before the cycle count C in the tag goes up

# The help desks of shared-prefix's system prompts; the first is the one of a single system prompt.
PLACES = ("a public library", "a science museum", "a city hospital", "a railway station", "a botanical garden",
          "a university", "a town hall", "an airport")
FOLLOW_UPS = [
    "Can you go into more detail on that?",
    "Give me a concrete example.",
    "Summarize what you said in one sentence.",
    "What would a skeptic say about this?",
    "How does this connect to everyday life?",
    "List the key points as bullets.",
    "What is the most common mistake people make here?",
    "Explain it again for a complete beginner.",
]


@dataclass(frozen=True)
class Session:
    messages: Conversation  # the first request's messages
    follow_ups: tuple[str, ...] = ()  # user turns sent after each answer (multi-turn only)
    model: str | None = None  # the model (or LoRA adapter) its requests name; None: the endpoint's

    @property
    def num_requests(self) -> int:
        return 1 + len(self.follow_ups)


@dataclass(frozen=True)
class ScenarioLengths:
    long_prompt_tokens: int = 1000
    shared_prefix_tokens: int = 500
    turns: int = 4  # requests per multi-turn session
    document_tokens: int = 0  # multi-turn: a document of this many tokens opens each session; 0: a chat opening
    system_prompts: int = 1  # shared-prefix: distinct system prompts, request i gets number i % system_prompts

    def __post_init__(self) -> None:
        if self.turns < 1 or self.system_prompts < 1 or self.document_tokens < 0:
            raise ValueError(f"turns and system_prompts must be positive and document_tokens not negative: {self}")


def build_sessions(scenario: str, num_requests: int, run: int, tokenizer: PreTrainedTokenizerBase,
                   lengths: ScenarioLengths) -> list[Session]:
    """Sessions holding exactly `num_requests` requests in all; the same on every call and machine."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    if scenario == "short-chat":
        return [Session(_tagged(chat_conversations()[i % POOL], run, i)) for i in range(num_requests)]
    if scenario == "long-prompt":
        return [Session(_tagged([{"role": "user", "content": _long_document(i, tokenizer, lengths.long_prompt_tokens)}],
                                run, i)) for i in range(num_requests)]
    if scenario == "shared-prefix":
        systems = [_handbook(tokenizer, lengths.shared_prefix_tokens, k) for k in range(lengths.system_prompts)]
        return [Session(_tagged([{"role": "system", "content": systems[i % len(systems)]},
                                 {"role": "user", "content": _question(i)}], run, i)) for i in range(num_requests)]
    if scenario == "multi-turn":
        sessions = []
        for i in range((num_requests + lengths.turns - 1) // lengths.turns):
            turns = min(lengths.turns, num_requests - i * lengths.turns)
            follow_ups = tuple(FOLLOW_UPS[(i + k) % len(FOLLOW_UPS)] for k in range(turns - 1))
            opening = ([{"role": "user", "content": _long_document(i, tokenizer, lengths.document_tokens)}]
                       if lengths.document_tokens else chat_conversations()[i % POOL])
            sessions.append(Session(_tagged(opening, run, i), follow_ups))
        return sessions
    raise ValueError(f"unknown scenario {scenario!r}; choose from {SCENARIOS}")


def _tagged(messages: Conversation, run: int, i: int) -> Conversation:
    first, *rest = messages
    return [{**first, "content": f"[run {run}.{i // POOL}] {first['content']}"}, *rest]


def _question(i: int) -> str:
    topic, other = TOPICS[(i * 7) % len(TOPICS)], TOPICS[(i * 7 + 13) % len(TOPICS)]
    return TEMPLATES[i % len(TEMPLATES)].format(topic=topic, other=other)


def _sentences(rng: random.Random, count: int = 400) -> str:
    """`count` plain sentences (each ~20 tokens); the first n are the same for any count >= n."""
    parts = []
    for k in range(count):
        if k % 17 == 16:
            parts.append(rng.choice(NOTES))
        else:
            topic, other = rng.choice(TOPICS), rng.choice(TOPICS)
            parts.append(f"Point {k + 1}: " + rng.choice(TEMPLATES).format(topic=topic, other=other))
    return " ".join(parts)


def _cut(text: str, tokenizer: PreTrainedTokenizerBase, num_tokens: int) -> str:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"the generated text has only {len(ids)} tokens; {num_tokens} asked for")
    return tokenizer.decode(ids[:num_tokens])


def _long_document(i: int, tokenizer: PreTrainedTokenizerBase, num_tokens: int) -> str:
    body = _cut(f"Document {i}. " + _sentences(random.Random(1000 + i), max(400, num_tokens // 10)), tokenizer,
                num_tokens)
    return f"{body}\n\nSummarize the document above in a few sentences."


def _handbook(tokenizer: PreTrainedTokenizerBase, num_tokens: int, variant: int = 0) -> str:
    """System prompt number `variant`: its own place and rules. All share their opening words (with the
    chat template, their first KV block), as the system prompts of one deployment tend to."""
    rules = _cut(_sentences(random.Random(7 + variant)), tokenizer, num_tokens)
    place = PLACES[variant % len(PLACES)] + (f" (branch {variant // len(PLACES)})" if variant >= len(PLACES) else "")
    return (f"You are the help desk of {place}. Read the study guide below; answer the visitor's "
            f"question in its spirit.\n\nStudy guide:\n{rules}")


def prompt_token_counts(sessions: Sequence[Session], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Prompt tokens of each session's first request, after the chat template."""
    return [len(apply_chat_template(tokenizer, s.messages)) for s in sessions]
