"""Varied prompts for the equivalence tests: raw text and chat conversations, from a few tokens to
about 1,500, built deterministically (no data downloads)."""

from __future__ import annotations

PARAGRAPHS = [
    "The history of paged memory begins with the Atlas computer at the University of Manchester, "
    "where a one-level store made a small core memory look as large as its drum. ",
    "A continuous-batching scheduler admits new requests at every step instead of waiting for a "
    "whole batch to finish, which keeps the accelerator busy when outputs have different lengths. ",
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs mostly blue and "
    "red light, and the Calvin cycle fixes carbon dioxide into sugars. ",
    "In 1969 the Apollo 11 lunar module landed in the Sea of Tranquility; Armstrong and Aldrin spent "
    "about two and a half hours outside, collecting 21.5 kilograms of samples. ",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "Rivers shape their valleys by erosion and deposition; meanders migrate across the flood plain "
    "and sometimes cut themselves off, leaving oxbow lakes behind. ",
]

RAW_PROMPTS = [
    "Hi",
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time, in a small village by the sea,",
    "Translate to French: Good morning, how are you?",
    "Q: What is the boiling point of water at sea level?\nA:",
    "import numpy as np\n\ndef softmax(x):",
    "The three primary colors are",
    "Write a haiku about autumn leaves:\n",
    "Photosynthesis is",
    "List of prime numbers: 2, 3, 5, 7,",
    "Dear hiring manager,",
]

CHAT_QUESTIONS = [
    "What is the tallest mountain in the world?",
    "Give me three tips for learning to play the guitar.",
    "Explain recursion to a five-year-old.",
    "Write a short poem about the ocean.",
    "What are the benefits of drinking water?",
    "How do I make a cup of tea?",
    "What is 17 times 23?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]


def long_text(num_paragraphs: int, offset: int = 0) -> str:
    return "".join(PARAGRAPHS[(offset + i) % len(PARAGRAPHS)] for i in range(num_paragraphs))


def conversations() -> list[list[dict[str, str]]]:
    convs = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS]
    convs.append([
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Name another one."},
    ])
    convs.append([{"role": "user", "content": "Summarize this text:\n" + long_text(6)}])
    return convs


def raw_prompts() -> list[str]:
    """Short raw prompts plus long ones of roughly 300, 700 and 1,500 tokens."""
    return RAW_PROMPTS + [long_text(8, 1), long_text(18, 2), long_text(40, 3) + "\nIn summary,"]
