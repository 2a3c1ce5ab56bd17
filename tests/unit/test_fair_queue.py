"""The waiting queue takes turns between tenants, then between client requests
(services/engine/request_queue.py), and the prompt-size bound refuses only what cannot fit
(services/common/prompt_size.py)."""

from __future__ import annotations

import pytest

from services.common.prompt_size import PromptSize, check_prompt_size, prompt_size, text_chars
from services.common.sampling_params import SamplingParams
from services.engine.request import Request
from services.engine.request_queue import FCFSRequestQueue, PriorityRequestQueue


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
    # Strings, numbers as written, one per entry of each object and array.
    assert text_chars({"a": ["bc", {"d": 5}]}) == 9
    assert prompt_size("hello", None) == PromptSize(5, 0)
    assert prompt_size(None, messages, [{"tools": "xyz"}]) == PromptSize(
        sum(len(k) + len(v) for m in messages for k, v in m.items()) + 2 + 5 + 9, 2)


def test_prompt_size_counts_numbers_and_empty_arrays_a_template_would_write():
    """A `tools` of numbers used to count as nothing, though `tojson` renders every digit."""
    assert text_chars([123456] * 1000) == 7000
    assert text_chars([[]] * 1000) == 1000
    assert text_chars([True, False, None, 1.5]) == 4 + 4 + 5 + 4 + 3
    assert text_chars(10**5000) > 5000  # no str() of it, which Python refuses past 4300 digits


@pytest.mark.parametrize("size, fits", [(PromptSize(400, 0), True), (PromptSize(401, 0), False),
                                        (PromptSize(10, 100), True), (PromptSize(10, 101), False)])
def test_a_prompt_is_refused_only_when_it_cannot_fit_the_context(size: PromptSize, fits: bool):
    if fits:
        check_prompt_size(size, max_model_len=100, max_token_chars=4)
    else:
        with pytest.raises(ValueError, match="--flag|messages"):
            check_prompt_size(size, max_model_len=100, max_token_chars=4, flag="--flag")


def tenant_request(rid: str, tenant: str, group: str | None = None, priority: int = 0) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(), 4, block_size=16, group_id=group, tenant_id=tenant,
                   priority=priority)


def test_tenants_take_turns_before_their_requests_do():
    queue = FCFSRequestQueue()
    for r in [tenant_request("k-a3", "K", "A"), tenant_request("k-a4", "K", "A"), tenant_request("k-b0", "K", "B"),
              tenant_request("l-c0", "L", "C"), tenant_request("l-c1", "L", "C")]:
        queue.add(r)
    assert [r.request_id for r in queue] == ["k-a3", "l-c0", "k-b0", "l-c1", "k-a4"]
    assert [queue.pop().request_id for _ in range(2)] == ["k-a3", "l-c0"]
    # A burst of one tenant's requests waits behind the other tenants' turns, not in front of them.
    for i in range(3):
        queue.add(tenant_request(f"m-{i}", "M"))
    assert [r.request_id for r in queue] == ["k-b0", "l-c1", "m-0", "k-a4", "m-1", "m-2"]
    preempted = tenant_request("l-c9", "L", "C")
    queue.add_preempted(preempted)  # its tenant and group first in turn
    assert queue.peek() is preempted and len(queue) == 7
    queue.remove(next(r for r in queue if r.request_id == "k-b0"))
    assert [queue.pop().request_id for _ in range(len(queue))] == ["l-c9", "k-a4", "m-0", "l-c1", "m-1", "m-2"]
    assert len(queue) == 0 and list(queue) == []


def test_the_priority_queue_takes_tenant_turns_within_one_priority():
    queue = PriorityRequestQueue()
    for r in [tenant_request("a0", "A"), tenant_request("a1", "A"), tenant_request("a2", "A", priority=1),
              tenant_request("b0", "B"), tenant_request("urgent", "B", priority=-1)]:
        queue.add(r)
    assert [r.request_id for r in queue] == ["urgent", "a0", "b0", "a1", "a2"]
    queue.remove(next(r for r in queue if r.request_id == "b0"))
    assert [queue.pop().request_id for _ in range(len(queue))] == ["urgent", "a0", "a1", "a2"]
    assert len(queue) == 0 and list(queue) == []
