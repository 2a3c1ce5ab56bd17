"""A gRPC health probe that speaks mutual TLS, for pods whose services require it (kubelet's own
gRPC probes speak plain text only):

    python -m services.common.rpc.health_probe --port 50052 --tls-cert-file ... --tls-key-file ... \
        --tls-ca-file ... --tls-server-name kvmesh-internal

Exit status 0 when the server on 127.0.0.1:<port> (or on --unix-socket PATH) says SERVING (for --service, default the overall
status), 1 otherwise. The health service needs no token.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from services.common.config import SecurityConfig
from services.common.flags import add_flags, build
from services.common.rpc.client import health_status
from services.common.rpc.security import RpcSecurity
from services.common.rpc.server import SERVING
from services.common.unix_socket import unix_address


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.rpc.health_probe", description=__doc__)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--port", type=int, help="the service's gRPC port on 127.0.0.1")
    where.add_argument("--unix-socket", type=Path, help="the service's gRPC Unix socket")
    parser.add_argument("--service", default="", help="the service whose status to ask (default: overall)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    add_flags(parser, SecurityConfig, None, exclude=["internal_token_file"])
    args = parser.parse_args(argv)
    security = RpcSecurity.load(build(parser, SecurityConfig, args))
    address = unix_address(args.unix_socket) if args.unix_socket is not None else f"127.0.0.1:{args.port}"
    with security.channel(address, []) as channel:
        try:
            status = health_status(channel, args.timeout, args.service)
        except grpc.RpcError as error:
            print(f"health check failed: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    if status != SERVING:
        print(f"not serving: {health_pb2.HealthCheckResponse.ServingStatus.Name(status)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
