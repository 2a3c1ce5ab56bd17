"""torch.distributed's stores have no authentication: whoever reaches a tensor-parallel rendezvous or
a worker's KV-transfer store could join the group or feed a transfer its own tensors. A worker keeps
every store key under a prefix derived from the internal token, so a client without the token
connects but never meets the group, and a transfer it tries to feed times out with nothing written
into the KV cache. Gloo's sockets listen on the rendezvous host's interface (loopback here), not on
the hostname's LAN address.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from services.worker.kv_transfer import KVTransferEndpoint, KVTransferError
from services.worker.parallel_group import free_loopback_address, interface_of, namespaced

REPO = Path(__file__).resolve().parents[2]

# One rank of a CPU tensor-parallel group of two, in its own process (a group is process-global).
RANK = """
import json, sys, psutil, torch
from services.common.config import ParallelConfig
from services.worker.parallel_group import GroupError, TensorParallelGroup
address, rank, secret = sys.argv[1], int(sys.argv[2]), sys.argv[3] or None
try:
    tp = TensorParallelGroup.create(ParallelConfig(tensor_parallel_size=2, rank=rank, distributed_address=address,
                                                   distributed_timeout=4.0), torch.device("cpu"), secret)
except GroupError:
    print(json.dumps({"joined": False}))
    sys.exit(0)
total = tp.all_reduce(torch.tensor([rank + 1.0])).item()
listening = sorted({c.laddr.ip for c in psutil.Process().net_connections("inet") if c.status == psutil.CONN_LISTEN})
tp.all_reduce(torch.tensor([0.0]))  # neither rank leaves before the other has looked at its sockets
print(json.dumps({"joined": True, "sum": total, "listening": listening}))
"""


def run_group(secrets: tuple[str, str]) -> list[dict]:
    address = free_loopback_address()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, address, str(rank), secret], cwd=REPO,
                              stdout=subprocess.PIPE, text=True) for rank, secret in enumerate(secrets)]
    try:
        return [json.loads(p.communicate(timeout=60)[0].strip().splitlines()[-1]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# The hostname may itself resolve to loopback (it does in some containers): this names the
# interface from the rendezvous address, whatever the hostname says.
def test_the_loopback_address_names_the_loopback_interface():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("localhost") == "lo"


@pytest.mark.slow
def test_ranks_with_the_token_form_a_group_that_listens_on_loopback_only():
    ranks = run_group(("token", "token"))
    assert [r["joined"] for r in ranks] == [True, True]
    assert [r["sum"] for r in ranks] == [3.0, 3.0]
    for r in ranks:
        assert r["listening"] and all(ip == "127.0.0.1" for ip in r["listening"]), r["listening"]


@pytest.mark.slow
def test_a_rank_without_the_token_never_joins_the_group():
    assert [r["joined"] for r in run_group(("token", ""))] == [False, False]


def test_a_store_client_without_the_token_cannot_read_or_overwrite_the_groups_keys():
    address = free_loopback_address()
    host, port = address.rsplit(":", 1)
    server = dist.TCPStore(host, int(port), is_master=True, wait_for_workers=False)
    group_view = namespaced(server, "token", "tensor-parallel")
    group_view.set("rank/0", "honest")
    rogue = dist.TCPStore(host, int(port), is_master=False)
    assert not rogue.check(["rank/0"])
    rogue.set("rank/0", "forged")
    assert group_view.get("rank/0") == b"honest"
    assert not namespaced(rogue, "guess", "tensor-parallel").check(["rank/0"])


def kv_caches(fill: float) -> list[torch.Tensor]:
    return [torch.full((2, 4, 16, 2, 8), fill) for _ in range(2)]  # [k/v, blocks, block size, heads, head dim]


def transfer(sender: KVTransferEndpoint, receiver: KVTransferEndpoint) -> tuple[list[torch.Tensor], Exception | None]:
    """`sender` sends blocks 0 and 1 of caches full of 7s into blocks 2 and 3 of zeroed ones."""
    target, failure = kv_caches(0.0), []

    def receive() -> None:
        try:
            receiver.receive(sender.endpoint_id, 5, target, [2, 3])
        except KVTransferError as exc:
            failure.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    try:
        sender.send(receiver.endpoint_id, 5, kv_caches(7.0), [0, 1])
    except KVTransferError as exc:
        failure.append(exc)
    thread.join(timeout=30)
    assert not thread.is_alive()
    return target, failure[0] if failure else None


def test_a_kv_transfer_from_a_peer_with_the_token_lands():
    receiver = KVTransferEndpoint("127.0.0.1:0", torch.device("cpu"), timeout=5.0, secret="token")
    sender = KVTransferEndpoint("127.0.0.1:0", torch.device("cpu"), timeout=5.0, secret="token")
    try:
        target, failure = transfer(sender, receiver)
        assert failure is None
        assert all(bool((kv[:, 2:4] == 7.0).all()) and bool((kv[:, :2] == 0.0).all()) for kv in target)
    finally:
        sender.close()
        receiver.close()


def test_a_kv_transfer_from_a_peer_without_the_token_writes_nothing():
    receiver = KVTransferEndpoint("127.0.0.1:0", torch.device("cpu"), timeout=1.5, secret="token")
    rogue = KVTransferEndpoint("127.0.0.1:0", torch.device("cpu"), timeout=1.5)
    try:
        target, failure = transfer(rogue, receiver)
        assert isinstance(failure, KVTransferError)
        assert all(bool((kv == 0.0).all()) for kv in target)
    finally:
        rogue.close()
        receiver.close()


def test_a_worker_guards_its_stores_with_the_shared_token_else_the_engines(tmp_path: Path):
    from services.common.config import SecurityConfig
    from services.worker.server import store_secret
    (tmp_path / "shared").write_text("shared-token\n")
    (tmp_path / "engine").write_text("engine-token\n")
    assert store_secret(SecurityConfig(engine_token_file=tmp_path / "engine")) == "engine-token"
    assert store_secret(SecurityConfig(internal_token_file=tmp_path / "shared",
                                       engine_token_file=tmp_path / "engine")) == "shared-token"
