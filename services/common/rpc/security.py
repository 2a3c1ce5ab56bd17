"""Who may call the internal gRPC services (worker, engine, processor), on both sides of a call.

Two layers, both grpcio's own machinery, nothing hand-rolled:

    token   a shared secret (SecurityConfig.internal_token_file: a mounted Kubernetes Secret, or
            $KVMESH_INTERNAL_TOKEN). Clients send it as `authorization: Bearer <token>` call
            metadata; TokenInterceptor, a server interceptor in front of every handler, compares it
            in constant time and answers UNAUTHENTICATED without calling the handler. The standard
            health service stays open (kubelet's gRPC probes send no metadata); reflection and every
            kvmesh service need the token.
    mTLS    optional (SecurityConfig.tls_*): servers listen with grpc.ssl_server_credentials and
            require a client certificate from the CA; clients dial with grpc.ssl_channel_credentials
            presenting theirs. A peer without a certificate from the CA never completes a handshake.

Without a token a server logs a warning that it is unauthenticated and serves anyone (a service
started by hand, off Kubernetes); `kvmesh serve` always gives its children a token of its own.

    security = RpcSecurity.load(config)                    # once, at the edge
    server = RpcServer(host, port, names, security=security)   # interceptor + credentials
    channel = security.aio_channel(address, GRPC_OPTIONS)       # token on every call (+ TLS)
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health

from services.common.config import SecurityConfig

logger = logging.getLogger(__name__)

TOKEN_ENV = "KVMESH_INTERNAL_TOKEN"
TOKEN_METADATA_KEY = "authorization"
# Methods callable without the token: the health service only (kubelet probes it).
OPEN_METHOD_PREFIXES = (f"/{health.SERVICE_NAME}/",)
UNAUTHENTICATED_MESSAGE = "this service needs the internal token (missing or wrong)"


def read_token(config: SecurityConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The token from the file, else from $KVMESH_INTERNAL_TOKEN, else None. ValueError for an
    empty one (a Secret mounted without its key would otherwise mean "no authentication")."""
    if config.internal_token_file is not None:
        token = Path(config.internal_token_file).read_text().strip()
        if not token:
            raise ValueError(f"the internal token file {config.internal_token_file} is empty")
        return token
    token = environ.get(TOKEN_ENV)
    if token is not None and not token.strip():
        raise ValueError(f"${TOKEN_ENV} is set but empty")
    return token.strip() if token else None


@dataclass(frozen=True)
class RpcSecurity:
    """What one process needs to serve and to call: the token (None: none) and, for mTLS, its
    certificate, key and CA as PEM bytes. `RpcSecurity()` is plain text without a token."""

    token: str | None = None
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    server_name: str | None = None

    @classmethod
    def load(cls, config: SecurityConfig) -> RpcSecurity:
        """Reads the files the config names (OSError when one cannot be read)."""
        if not config.tls:
            return cls(read_token(config))
        return cls(read_token(config), Path(config.tls_cert_file).read_bytes(), Path(config.tls_key_file).read_bytes(),
                   Path(config.tls_ca_file).read_bytes(), config.tls_server_name)

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call carries (empty without a token)."""
        return ((TOKEN_METADATA_KEY, f"Bearer {self.token}"),) if self.token else ()

    # ------------------------------------------------------------------ server side

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenInterceptor(self.token)] if self.token else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on `address`: mTLS (client certificates required) or plain text."""
        if not self.tls:
            return server.add_insecure_port(address)
        credentials = grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                                  require_client_auth=True)
        return server.add_secure_port(address, credentials)

    def warn_if_open(self, what: str) -> None:
        if self.token is None:
            logger.warning("%s is UNAUTHENTICATED: no internal token (--internal-token-file or $%s), so anyone "
                           "who reaches its port may call it", what, TOKEN_ENV)

    # ------------------------------------------------------------------ client side

    def aio_channel(self, address: str, options: Sequence[tuple[str, object]],
                    interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
        """A grpc.aio channel whose every call carries the token (first, so that other interceptors
        see the call as sent)."""
        interceptors = [*_token_client_interceptors(self.call_metadata), *interceptors]
        if not self.tls:
            return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors or None)
        return grpc.aio.secure_channel(address, self._channel_credentials(), options=self._options(options),
                                       interceptors=interceptors or None)

    def channel(self, address: str, options: Sequence[tuple[str, object]]) -> grpc.Channel:
        """A blocking channel, plain or mTLS. Its caller passes `call_metadata` on each call (the
        engine's step path: no interceptor on the hottest call there is)."""
        if not self.tls:
            return grpc.insecure_channel(address, options=options)
        return grpc.secure_channel(address, self._channel_credentials(), options=self._options(options))

    # ------------------------------------------------------------------ plain sockets (the step channel)

    def token_matches(self, sent: str) -> bool:
        """Whether `sent` is this process's token, in constant time (True when it has none)."""
        return self.token is None or hmac.compare_digest(sent.encode(), self.token.encode())

    def ssl_context(self, server: bool) -> ssl.SSLContext:
        """The same mutual TLS as the gRPC channels, for a plain socket: this process's certificate,
        the peer's required and checked against the CA (a client also checks the server's name)."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(cadata=self.ca.decode())
        # ssl loads a certificate chain from files only: a private file for the moment it takes.
        with tempfile.TemporaryDirectory(prefix="kvmesh-tls-") as private:
            chain = Path(private) / "chain.pem"
            chain.touch(mode=0o600)
            chain.write_bytes(self.key + b"\n" + self.cert)
            context.load_cert_chain(chain)
        return context

    def _channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def _options(self, options: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
        if self.server_name is None:
            return list(options)
        return [*options, ("grpc.ssl_target_name_override", self.server_name)]


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call without the right token UNAUTHENTICATED before its handler runs; the
    health service is open."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        sent = next((value for key, value in metadata or () if key == TOKEN_METADATA_KEY), None)
        if sent is None:
            return False
        return hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES)
                or self.authorized(handler_call_details.invocation_metadata)):
            return handler
        return _refusing(handler)


async def _refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses the call without reading a message."""
    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[(handler.request_streaming,
                                                                 handler.response_streaming)]
    return make(_refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


# ----------------------------------------------------------------------------- client interceptors
# grpc.aio files an interceptor under the first kind it is an instance of: one class per kind.


class _WithMetadata:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self.metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


class _UnaryUnary(_WithMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self.details(client_call_details), request)


class _UnaryStream(_WithMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self.details(client_call_details), request)


class _StreamStream(_WithMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(self.details(client_call_details), request_iterator)


def _token_client_interceptors(metadata: tuple[tuple[str, str], ...]) -> list[grpc.aio.ClientInterceptor]:
    if not metadata:
        return []
    return [_UnaryUnary(metadata), _UnaryStream(metadata), _StreamStream(metadata)]
