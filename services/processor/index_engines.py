"""Which of the prefix index's live engines a processor may dial (--engines-from-index).

Anyone who can write to Redis can add an engine id, and an id is an address: unchecked, the
processor would dial it and send it prompts and its token. So an id becomes a member only when

    the allow-list vouches for it      --engine-allowed-address host:port | IP | CIDR (or
                                        --trust-index-engines: every address), and
    the engine proves who it is        ProveIdentity over a channel without the token: the answer
                                        HMAC(processor token, nonce || id) needs the token the real
                                        engine verifies. With mutual TLS the server certificate,
                                        checked against the CA, is the proof; without any token
                                        there is nothing to prove with, and the allow-list alone holds.

A proven engine stays a member while it stays live in the index; one that failed is asked again
after RETRY_S, and at most MAX_CHALLENGES new ids are asked per poll, so forged entries cost a
bounded number of calls.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import secrets
import time
from collections.abc import Iterable, Sequence

import grpc

from services.common.rpc.kvmesh.v1 import engine_pb2, engine_pb2_grpc
from services.common.rpc.security import RpcSecurity

logger = logging.getLogger(__name__)

RETRY_S = 30.0  # seconds before an engine that failed its proof is asked again
MAX_CHALLENGES = 16  # new engine ids asked per poll
NONCE_BYTES = 32


class AllowList:
    """host:port entries match exactly; an IP or a CIDR network matches that host on any port."""

    def __init__(self, entries: Sequence[str]) -> None:
        self.addresses: set[str] = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in entries:
            try:
                self.networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                self.addresses.add(entry.lower())

    def allows(self, address: str) -> bool:
        if address.lower() in self.addresses:
            return True
        host = address.rpartition(":")[0].strip("[]")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return False  # a host name matches only an exact host:port entry
        return any(ip in network for network in self.networks)


async def proves_identity(address: str, security: RpcSecurity, timeout: float) -> bool:
    """Whether the engine at `address` holds this processor's token (its id must be `address`).
    Asked over a channel that carries no token; False for any failure."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    challenge = engine_pb2.IdentityChallenge(nonce=nonce, role=security.role or "")
    channel = grpc.aio.insecure_channel(address)
    try:
        answer = await engine_pb2_grpc.EngineStub(channel).ProveIdentity(challenge, timeout=timeout)
    except grpc.RpcError as e:
        logger.warning("engine %s named by the prefix index did not prove its identity: %s", address, e.code())
        return False
    finally:
        await channel.close()
    if answer.engine_id != address or not security.verifies(nonce, answer.engine_id, answer.proof):
        logger.warning("engine %s named by the prefix index failed its identity proof: not dialled with the token",
                       address)
        return False
    return True


class IndexEngines:
    """Filters the index's live engine ids down to those a processor may dial (see the module)."""

    def __init__(self, allowed: Sequence[str], trust_all: bool, security: RpcSecurity, timeout: float) -> None:
        self.allow_list = AllowList(allowed)
        self.trust_all = trust_all
        self.security = security
        self.timeout = timeout
        self.proven: set[str] = set()
        self.failed: dict[str, float] = {}  # id -> time.monotonic() of its last failed proof
        self._refused: set[str] = set()  # logged once each while live

    @property
    def needs_proof(self) -> bool:
        """A token to protect and no mutual TLS to rely on."""
        return self.security.token is not None and not self.security.tls

    def allows(self, address: str) -> bool:
        return self.trust_all or self.allow_list.allows(address)

    async def vouched(self, live: Iterable[str]) -> frozenset[str]:
        """The ids of `live` this processor may dial now."""
        live = set(live)
        self.proven &= live
        self.failed = {a: t for a, t in self.failed.items() if a in live}
        self._refused &= live
        allowed = set()
        for address in sorted(live):
            if self.allows(address):
                allowed.add(address)
            elif address not in self._refused:
                self._refused.add(address)
                logger.warning("the prefix index names engine %s, which no --engine-allowed-address allows: "
                               "not dialled", address)
        if not self.needs_proof:
            return frozenset(allowed)
        now = time.monotonic()
        due = [a for a in sorted(allowed - self.proven) if now - self.failed.get(a, -RETRY_S) >= RETRY_S]
        due = due[:MAX_CHALLENGES]
        results = await asyncio.gather(*(proves_identity(a, self.security, self.timeout) for a in due))
        for address, proven in zip(due, results):
            if proven:
                self.proven.add(address)
                self.failed.pop(address, None)
            else:
                self.failed[address] = now
        return frozenset(allowed & self.proven)
