"""128 deterministic, varied, short chat conversations for the throughput benchmarks (no downloads).

Most are a single user turn built from a task template and a topic; every 8th has its own system
message, every 9th carries a short multi-turn history, every 13th quotes a note to work on. After
SmolLM2's chat template (which adds a ~20-token default system message when there is none) they come
to 33-131 tokens (median 42, mean 51).

    .venv/bin/python -m loadtests.chat_prompts            # prints token-length stats and a few samples
"""

from __future__ import annotations

import argparse
import statistics

from services.processor.tokenizer import apply_chat_template, load_tokenizer
from services.worker.loader import resolve_model

Conversation = list[dict[str, str]]

TOPICS = [
    "black holes", "the French Revolution", "sourdough bread", "compound interest", "photosynthesis",
    "the Roman aqueducts", "quantum entanglement", "jazz improvisation", "volcanoes", "honeybees",
    "the printing press", "machine learning", "coral reefs", "the Silk Road", "electric cars",
    "origami", "the immune system", "chess openings", "plate tectonics", "the Great Wall of China",
    "recursion", "coffee brewing", "the water cycle", "Shakespeare's sonnets", "solar panels",
    "the human heart", "supply and demand", "octopuses", "the Apollo missions", "hash tables",
    "mountain climbing", "the Renaissance", "wind turbines", "vaccines", "public libraries",
    "the metric system", "sleep", "glaciers", "board games", "the internet", "lighthouses",
]

TEMPLATES = [
    "Explain {topic} in simple terms.",
    "Write a short poem about {topic}.",
    "Give me three surprising facts about {topic}.",
    "What are the main pros and cons of {topic}?",
    "Summarize the history of {topic} in one paragraph.",
    "How would you teach {topic} to a curious ten-year-old? Give a step-by-step plan.",
    "Write a two-sentence story that involves {topic}.",
    "What is a common misconception about {topic}, and what is the truth?",
    "List five questions a student might ask about {topic}.",
    "Compare {topic} with {other}. How are they alike and how do they differ?",
    "I have to give a five-minute talk on {topic} tomorrow. Suggest an outline with an opening hook.",
    "Describe {topic} as if you were a tour guide showing it to visitors.",
]

SYSTEM_MESSAGES = [
    "You are a concise assistant. Answer in at most three sentences.",
    "You are a friendly science teacher who loves analogies.",
    "You are a pirate. Stay in character no matter what.",
    "You are a careful editor. Prefer plain words and short sentences.",
    "You answer every question as a numbered list.",
]

# (opening question, the assistant's answer, the follow-up): a history the model has to read.
HISTORIES = [
    ("What is {topic}?", "In short, {topic} is a subject people have studied for a long time.",
     "Can you give me a concrete example?"),
    ("Do you know much about {topic}?", "Yes, I can tell you the basics of {topic}.",
     "Great. What is the single most important thing to know?"),
    ("Tell me one fact about {topic}.", "Here is one: {topic} has a longer history than most people think.",
     "Interesting! Why is that the case, and who first studied it?"),
]

NOTES = [
    "Meeting notes: the team agreed to ship the beta on Friday, Ana owns the release checklist, "
    "and the load test showed the cache hit rate dropping to 40% under bursty traffic.",
    "Recipe: mix 500 g flour, 350 g water and 10 g salt, rest for an hour, fold four times, "
    "proof overnight in the fridge and bake at 250 degrees for 40 minutes.",
    "Bug report: after upgrading the driver, the service starts but every third request times out "
    "after 30 seconds; rolling back fixes it, and the logs show no errors. It happens on two of our "
    "five machines, both with the newer network cards, and only when more than sixteen clients are "
    "connected at once; with TLS turned off the timeouts go away, and the CPU stays below 20%.",
]


def _conversation(i: int) -> Conversation:
    topic = TOPICS[(i * 7) % len(TOPICS)]
    other = TOPICS[(i * 7 + 13) % len(TOPICS)]
    if i % 13 == 5:
        note = NOTES[(i // 13) % len(NOTES)]
        return [{"role": "user", "content": f"{note}\n\nSummarize this in one sentence, then relate it to {topic}."}]
    if i % 9 == 4:
        first, answer, follow_up = HISTORIES[(i // 9) % len(HISTORIES)]
        return [
            {"role": "user", "content": first.format(topic=topic)},
            {"role": "assistant", "content": answer.format(topic=topic)},
            {"role": "user", "content": follow_up},
        ]
    user = {"role": "user", "content": TEMPLATES[i % len(TEMPLATES)].format(topic=topic, other=other)}
    if i % 8 == 3:
        return [{"role": "system", "content": SYSTEM_MESSAGES[(i // 8) % len(SYSTEM_MESSAGES)]}, user]
    return [user]


def chat_conversations(n: int = 128) -> list[Conversation]:
    """The first `n` conversations; the same list on every call and machine."""
    if not 0 < n <= 128:
        raise ValueError(f"there are 128 benchmark conversations; asked for {n}")
    return [_conversation(i) for i in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--show", type=int, default=4, help="how many rendered prompts to print")
    args = parser.parse_args()

    tokenizer = load_tokenizer(resolve_model("smollm2", None))
    conversations = chat_conversations(args.num_prompts)
    lengths = [len(apply_chat_template(tokenizer, c)) for c in conversations]
    distinct = len({repr(c) for c in conversations})
    print(f"{len(conversations)} conversations ({distinct} distinct); prompt tokens after the chat template: "
          f"min {min(lengths)}, median {statistics.median(lengths):g}, mean {statistics.mean(lengths):.1f}, "
          f"max {max(lengths)}, total {sum(lengths)}")
    for c in conversations[: args.show]:
        print("---")
        print(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False))


if __name__ == "__main__":
    main()
