"""services/worker/kv_transfer.py over real gloo on loopback, both ends in this process (a thread
each): blocks arrive where they were asked for, groups are made once per pair and reused, a peer
that never comes fails the transfer within the timeout, a restarted peer replaces its predecessor."""

from __future__ import annotations

import threading

import pytest
import torch

from services.worker.kv_transfer import KVTransferEndpoint, KVTransferError

CPU = torch.device("cpu")


def caches(num_blocks: int, seed: int | None) -> list[torch.Tensor]:
    shape = (2, num_blocks, 4, 2, 8)  # [K/V, blocks, block_size, kv_heads, head_size]
    if seed is None:
        return [torch.zeros(shape) for _ in range(3)]
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(3)]


def transfer(sender: KVTransferEndpoint, receiver: KVTransferEndpoint, src: list[torch.Tensor],
             dst: list[torch.Tensor], src_ids: list[int], dst_ids: list[int], tag: int) -> int:
    sent: list[int] = []
    thread = threading.Thread(target=lambda: sent.append(sender.send(receiver.endpoint_id, tag, src, src_ids)))
    thread.start()
    received = receiver.receive(sender.endpoint_id, tag, dst, dst_ids)
    thread.join(5)
    assert sent == [received]
    return received


def test_blocks_arrive_in_order_and_the_pair_group_is_reused():
    p, d = KVTransferEndpoint("127.0.0.1:0", CPU, 5.0), KVTransferEndpoint("127.0.0.1:0", CPU, 5.0)
    assert p.endpoint_id.startswith("127.0.0.1:") and p.endpoint_id != d.endpoint_id
    src, dst = caches(6, seed=0), caches(8, seed=None)
    assert transfer(p, d, src, dst, [4, 1], [2, 7], tag=1) == 3 * 2 * 2 * 4 * 2 * 8 * 4  # layers, K/V, blocks, ...
    for s, t in zip(src, dst):
        assert torch.equal(t[:, 2], s[:, 4]) and torch.equal(t[:, 7], s[:, 1])
        assert t[:, [0, 1, 3, 4, 5, 6]].abs().sum() == 0  # nothing else written
    assert p.num_groups == d.num_groups == 1
    transfer(p, d, src, dst, [0], [0], tag=2)
    assert torch.equal(dst[0][:, 0], src[0][:, 0])
    assert p.num_groups == d.num_groups == 1  # the same pair's group, no second rendezvous


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_caches_arrive_bit_for_bit(dtype):
    # `--dtype bfloat16` and `--dtype float16` workers send their caches as they hold them, half float32's bytes.
    p, d = KVTransferEndpoint("127.0.0.1:0", CPU, 5.0), KVTransferEndpoint("127.0.0.1:0", CPU, 5.0)
    src, dst = [c.to(dtype) for c in caches(3, seed=1)], [c.to(dtype) for c in caches(3, seed=None)]
    assert transfer(p, d, src, dst, [2, 0], [1, 2], tag=1) == 3 * 2 * 2 * 4 * 2 * 8 * 2
    for s, t in zip(src, dst):
        assert torch.equal(t[:, 1], s[:, 2]) and torch.equal(t[:, 2], s[:, 0]) and t[:, 0].abs().sum() == 0


def test_a_sender_that_never_comes_fails_the_receive_within_the_timeout():
    d = KVTransferEndpoint("127.0.0.1:0", CPU, 0.3)
    absent = KVTransferEndpoint("127.0.0.1:0", CPU, 0.3)
    with pytest.raises(KVTransferError, match="receiving 1 KV blocks"):
        d.receive(absent.endpoint_id, 5, caches(2, seed=None), [1])
    assert d.num_groups == 0


def test_a_restarted_peer_replaces_its_predecessors_group():
    d = KVTransferEndpoint("127.0.0.1:0", CPU, 5.0)
    first = KVTransferEndpoint("127.0.0.1:0", CPU, 5.0)
    src, dst = caches(2, seed=1), caches(2, seed=None)
    transfer(first, d, src, dst, [0], [1], tag=1)
    # The same host:port, another start: a new endpoint id (the predecessor's group is never used again).
    second = KVTransferEndpoint("127.0.0.1:0", CPU, 5.0)
    second.endpoint_id = first.endpoint_id.partition("/")[0] + "/restarted"
    first.close()
    transfer(second, d, src, dst, [1], [0], tag=2)
    assert torch.equal(dst[0][:, 0], src[0][:, 1])
    assert d.num_groups == 1


def test_two_first_transfers_in_opposite_orders_on_each_side_both_arrive():
    """Two transfers over a new pair at once, the receiver starting one first and the sender the
    other: neither side may hold the pair while it waits for a transfer the other side is not at."""
    p, d = KVTransferEndpoint("127.0.0.1:0", CPU, 3.0), KVTransferEndpoint("127.0.0.1:0", CPU, 3.0)
    src, dst = caches(4, seed=2), caches(4, seed=None)
    received: dict[int, int] = {}
    sent: dict[int, int] = {}
    receive_a = threading.Thread(target=lambda: received.__setitem__(1, d.receive(p.endpoint_id, 1, dst, [0])))
    receive_a.start()
    send_b = threading.Thread(target=lambda: sent.__setitem__(2, p.send(d.endpoint_id, 2, src, [3])))
    send_b.start()  # the sender is at B while the receiver rendezvouses for A
    threading.Event().wait(0.2)
    receive_b = threading.Thread(target=lambda: received.__setitem__(2, d.receive(p.endpoint_id, 2, dst, [1])))
    receive_b.start()
    sent[1] = p.send(d.endpoint_id, 1, src, [2])
    for thread in (receive_a, send_b, receive_b):
        thread.join(10)
    assert received == sent and set(sent) == {1, 2}
    assert torch.equal(dst[0][:, 0], src[0][:, 2]) and torch.equal(dst[0][:, 1], src[0][:, 3])
    assert p.num_groups == d.num_groups == 1
