"""The FCFS waiting queue takes turns between client requests (services/engine/request_queue.py),
and the prompt-size bound refuses only what cannot fit (services/common/prompt_size.py)."""

from __future__ import annotations

import pytest

from services.common.prompt_size import PromptSize, check_prompt_size, prompt_size, text_chars
from services.common.sampling_params import SamplingParams
from services.engine.request import Request
from services.engine.request_queue import FCFSRequestQueue


def request(rid: str, group: str | None = None) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(), 4, block_size=16, group_id=group)


def test_sequences_of_one_request_take_turns_with_other_requests():
    queue = FCFSRequestQueue()
    big = [request(f"a-{i}", "a") for i in range(4)]
    for r in big:
        queue.add(r)
    assert queue.pop() is big[0]
    small, other = request("b"), request("c-0", "c")  # no group: its own
    queue.add(small)
    queue.add(other)
    assert [r.request_id for r in queue] == ["a-1", "b", "c-0", "a-2", "a-3"]
    assert [queue.pop().request_id for _ in range(3)] == ["a-1", "b", "c-0"]
    queue.add_preempted(small)  # back to the front, its group first in turn
    assert queue.peek() is small and len(queue) == 3
    queue.remove(big[3])
    assert [queue.pop().request_id for _ in range(len(queue))] == ["b", "a-2"]
    assert len(queue) == 0 and list(queue) == []


def test_requests_of_one_sequence_each_are_first_come_first_served():
    queue = FCFSRequestQueue()
    requests = [request(str(i)) for i in range(5)]
    for r in requests:
        queue.add(r)
    assert [queue.pop() for _ in range(5)] == requests


def test_prompt_size_counts_every_string_and_the_messages():
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi", "name": "bot"}]
    assert text_chars({"a": ["bc", {"d": 5}]}) == 4
    assert prompt_size("hello", None) == PromptSize(5, 0)
    assert prompt_size(None, messages, [{"tools": "xyz"}]) == PromptSize(
        sum(len(k) + len(v) for m in messages for k, v in m.items()) + 8, 2)


@pytest.mark.parametrize("size, fits", [(PromptSize(400, 0), True), (PromptSize(401, 0), False),
                                        (PromptSize(10, 100), True), (PromptSize(10, 101), False)])
def test_a_prompt_is_refused_only_when_it_cannot_fit_the_context(size: PromptSize, fits: bool):
    if fits:
        check_prompt_size(size, max_model_len=100, max_token_chars=4)
    else:
        with pytest.raises(ValueError, match="--flag|messages"):
            check_prompt_size(size, max_model_len=100, max_token_chars=4, flag="--flag")
