"""The default port of each service, and of its /metrics: what a service listens on when its
flags name none, what its callers dial by default, what the images expose and the chart's values
say (tests/deploy/test_ports.py holds those two to this table).

    gateway     8000   HTTP: the OpenAI API, /health and /metrics on the same port
    processor  50051   gRPC, /metrics on 9051
    engine     50052   gRPC, /metrics on 9052
    worker     50053   gRPC, /metrics on 9053
"""

from __future__ import annotations

from typing import NamedTuple

LOOPBACK = "127.0.0.1"


class ServicePorts(NamedTuple):
    port: int  # the service's own: gRPC, or the gateway's HTTP
    metrics_port: int | None  # a separate /metrics (None: on `port`)


DEFAULT_PORTS: dict[str, ServicePorts] = {
    "gateway": ServicePorts(8000, None),
    "processor": ServicePorts(50051, 9051),
    "engine": ServicePorts(50052, 9052),
    "worker": ServicePorts(50053, 9053),
}


def default_address(service: str) -> str:
    """Where a caller on the same machine finds `service` by default (host:port)."""
    return f"{LOOPBACK}:{DEFAULT_PORTS[service].port}"
