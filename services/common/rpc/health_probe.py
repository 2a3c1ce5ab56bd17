"""A gRPC health probe that speaks mutual TLS, for pods whose services require it (kubelet's own
gRPC probes speak plain text only):

    python -m services.common.rpc.health_probe --port 50052 --tls-cert-file ... --tls-key-file ... \
        --tls-ca-file ... --tls-server-name kvmesh-internal

Exit status 0 when the server on 127.0.0.1:<port> says SERVING (for --service, default the overall
status), 1 otherwise. The health service needs no token.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.config import SecurityConfig
from services.common.flags import add_flags, build
from services.common.rpc.security import RpcSecurity
from services.common.rpc.server import SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.rpc.health_probe", description=__doc__)
    parser.add_argument("--port", type=int, required=True, help="the service's gRPC port on 127.0.0.1")
    parser.add_argument("--service", default="", help="the service whose status to ask (default: overall)")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for the answer")
    add_flags(parser, SecurityConfig, None, exclude=["internal_token_file"])
    args = parser.parse_args(argv)
    security = RpcSecurity.load(build(parser, SecurityConfig, args))
    with security.channel(f"127.0.0.1:{args.port}", []) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                              timeout=args.timeout)
        except grpc.RpcError as error:
            print(f"health check failed: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    if reply.status != SERVING:
        print(f"not serving: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
