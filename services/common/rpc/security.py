"""Who may call the internal gRPC services (worker, engine, processor), on both sides of a call.

Two layers, both grpcio's own machinery, nothing hand-rolled:

    tokens  one secret per caller role (SecurityConfig.{gateway,processor,engine}_token_file: a
            mounted Kubernetes Secret each), or one shared by every role
            (SecurityConfig.internal_token_file, or $KVMESH_INTERNAL_TOKEN). Clients send their own
            role's token as `authorization: Bearer <token>` call metadata, and its role as
            `kvmesh-role`; TokenInterceptor, a server interceptor in front of every handler, answers
            PERMISSION_DENIED for a role that may not call the method (SERVICE_CALLERS,
            METHOD_CALLERS), then UNAUTHENTICATED unless the token is that role's (or the shared
            one), compared in constant time, all without calling the handler. The standard health
            service stays open (kubelet's gRPC probes send no metadata); reflection needs a token
            of any role.
    mTLS    optional (SecurityConfig.tls_*): servers listen with grpc.ssl_server_credentials and
            require a client certificate from the CA; clients dial with grpc.ssl_channel_credentials
            presenting theirs. A peer without a certificate from the CA never completes a handshake.

Who calls what: the gateway calls the Processor service only; the processor calls the
Engine's client methods; an engine calls its workers, and a decode engine a prefill engine's
Prefill, ReleaseTransfer and GetInfo. So the internet-facing gateway's token opens no engine and no
worker. The shared token stands for every role, for services started by hand.

Without a token a server logs a warning that it is unauthenticated and serves anyone (a service
started by hand, off Kubernetes); `kvmesh serve` gives each child the role tokens it sends or checks.
A refused call is counted in kvmesh_rpc_refused_total{service,reason} and logged, at most once a
minute per service and reason, so that a flood of them costs a dict look-up each, not a log line.

    security = RpcSecurity.load(config, "engine")          # once, at the edge, as this process's role
    server = RpcServer(host, port, names, security=security)   # interceptor + credentials
    channel = security.aio_channel(address, GRPC_OPTIONS)       # this role's token on every call (+ TLS)
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import ssl
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from services.common.config import SecurityConfig

logger = logging.getLogger(__name__)

TOKEN_ENV = "KVMESH_INTERNAL_TOKEN"
TOKEN_METADATA_KEY = "authorization"
# The role a caller's token is of, sent beside it: a role that may not call a method is refused at
# once (PERMISSION_DENIED), by a server that need not hold that role's token to say so.
ROLE_METADATA_KEY = "kvmesh-role"
# An engine proves to a processor that found it in the prefix index that it holds the processor
# token, before the processor sends it that token (identity_proof): necessarily without a token.
PROVE_IDENTITY_METHOD = "/kvmesh.v1.Engine/ProveIdentity"
# Methods callable without the token: the health service (kubelet probes it) and the proof.
OPEN_METHOD_PREFIXES = (f"/{health.SERVICE_NAME}/", PROVE_IDENTITY_METHOD)
IDENTITY_NONCE_BYTES = (16, 64)  # the bounds of a challenge's nonce
_IDENTITY_LABEL = b"kvmesh engine identity\0"  # a proof is good for nothing but this
UNAUTHENTICATED_MESSAGE = "this service needs the internal token (missing or wrong)"

# Caller roles: each has its own token. ANY is the role of the shared token, which may call everything.
GATEWAY, PROCESSOR, ENGINE = "gateway", "processor", "engine"
ROLES = (GATEWAY, PROCESSOR, ENGINE)
ANY = "any"
# The worker's step channel is no gRPC method; its hello is authorized as if it were this one.
STEP_CHANNEL_METHOD = "/kvmesh.v1.Worker/StepChannel"

_REFLECTION = frozenset(ROLES)  # read-only, and a debugging aid for whoever holds a token
# Who may call each method: a method's own entry, else its service's, else nobody but the shared token.
# Every method of every kvmesh service is classified here (a test checks the protos against it).
SERVICE_CALLERS: dict[str, frozenset[str]] = {
    "kvmesh.v1.Processor": frozenset({GATEWAY}),
    "kvmesh.v1.Engine": frozenset({PROCESSOR}),  # Generate, Abort, GetStats, MatchPrefix
    "kvmesh.v1.Worker": frozenset({ENGINE}),  # GetInfo, InitializeCache, SendKV, ReceiveKV, the step channel
    "grpc.reflection.v1alpha.ServerReflection": _REFLECTION,
    "grpc.reflection.v1.ServerReflection": _REFLECTION,
}
METHOD_CALLERS: dict[str, frozenset[str]] = {
    # A decode engine asks a prefill engine for its workers' KV endpoints, then to prefill and to release.
    "/kvmesh.v1.Engine/GetInfo": frozenset({PROCESSOR, ENGINE}),
    "/kvmesh.v1.Engine/Prefill": frozenset({ENGINE}),
    "/kvmesh.v1.Engine/ReleaseTransfer": frozenset({ENGINE}),
    PROVE_IDENTITY_METHOD: frozenset({PROCESSOR}),  # open (OPEN_METHOD_PREFIXES); processors are who ask
    STEP_CHANNEL_METHOD: frozenset({ENGINE}),
}
PERMISSION_DENIED_MESSAGE = "this caller's credential may not call {method}"


def callers_of(method: str) -> frozenset[str]:
    """The roles that may call `method` ("/package.Service/Method"); the shared token may call all."""
    allowed = METHOD_CALLERS.get(method)
    if allowed is None:
        allowed = SERVICE_CALLERS.get(method.lstrip("/").rpartition("/")[0], frozenset())
    return allowed | {ANY}


def identity_proof(token: str, nonce: bytes, engine_id: str) -> bytes:
    """HMAC-SHA256 under `token` of the nonce and the engine's id: what only a holder of the token
    computes, for that id only (a relay of another engine's proof names the wrong id)."""
    return hmac.new(token.encode(), _IDENTITY_LABEL + nonce + engine_id.encode(), hashlib.sha256).digest()


def read_token(config: SecurityConfig, environ: Mapping[str, str] = os.environ) -> str | None:
    """The shared token from the file, else from $KVMESH_INTERNAL_TOKEN, else None. ValueError for
    an empty one (a Secret mounted without its key would otherwise mean "no authentication")."""
    if config.internal_token_file is not None:
        return read_token_file(config.internal_token_file)
    token = environ.get(TOKEN_ENV)
    if token is not None and not token.strip():
        raise ValueError(f"${TOKEN_ENV} is set but empty")
    return token.strip() if token else None


def read_token_file(path: Path) -> str:
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"the internal token file {path} is empty")
    return token


def read_role_tokens(config: SecurityConfig) -> dict[str, str]:
    """The role tokens the config names, by role."""
    files = {GATEWAY: config.gateway_token_file, PROCESSOR: config.processor_token_file,
             ENGINE: config.engine_token_file}
    return {role: read_token_file(path) for role, path in files.items() if path is not None}


class Refusals:
    """Refused internal calls: counted by (service, reason) for kvmesh_rpc_refused_total, and logged
    at most once a minute per pair (a flood of refusals must not become a flood of log lines).
    Thread-safe: gRPC refuses on the event loop, the step channel on its handshake threads."""

    LOG_INTERVAL = 60.0  # seconds

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._next_log: dict[tuple[str, str], float] = {}
        self._unlogged: dict[tuple[str, str], int] = {}

    def refuse(self, service: str, reason: grpc.StatusCode, detail: str) -> None:
        key = (service, reason.name)
        now = time.monotonic()
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            self._unlogged[key] = self._unlogged.get(key, 0) + 1
            if now < self._next_log.get(key, 0.0):
                return
            self._next_log[key] = now + self.LOG_INTERVAL
            count, self._unlogged[key] = self._unlogged[key], 0
        logger.warning("refused %d internal call(s) to %s with %s in the last %gs (latest: %s)", count, service,
                       reason.name, self.LOG_INTERVAL, detail)

    def count(self, service: str, reason: grpc.StatusCode) -> int:
        with self._lock:
            return self._counts.get((service, reason.name), 0)

    def register(self, registry: CollectorRegistry) -> None:
        """Serve the counts on `registry` (a process's /metrics)."""
        registry.register(self)

    def describe(self) -> list:
        return []  # the family appears at the first collect (prometheus-client's own protocol)

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily("kvmesh_rpc_refused", "internal calls refused before any handler ran, by "
                                     "service and reason (UNAUTHENTICATED, PERMISSION_DENIED)",
                                     labels=["service", "reason"])
        with self._lock:
            counts = dict(self._counts)
        for (service, reason), count in sorted(counts.items()):
            family.add_metric([service, reason], count)
        yield family


@dataclass(frozen=True)
class RpcSecurity:
    """What one process needs to serve and to call: `token`, the credential it sends (None: none);
    `callers`, the tokens it accepts as (token, role) pairs (empty: `token`, as the shared one);
    and, for mTLS, its certificate, key and CA as PEM bytes. `RpcSecurity()` is plain text
    without a token; `RpcSecurity("t")` sends and accepts the shared token "t"."""

    token: str | None = None
    cert: bytes | None = None
    key: bytes | None = None
    ca: bytes | None = None
    server_name: str | None = None
    callers: tuple[tuple[str, str], ...] = ()
    role: str | None = None  # the role of `token` (None: the shared token, of every role)
    refusals: Refusals = field(default_factory=Refusals, compare=False, repr=False)

    @classmethod
    def load(cls, config: SecurityConfig, role: str | None = None) -> RpcSecurity:
        """Reads the files the config names (OSError when one cannot be read). `role` is this
        process's: it sends that role's token, else the shared one (a worker calls no one)."""
        shared, tokens = read_token(config), read_role_tokens(config)
        callers = (*(((shared, ANY),) if shared else ()), *((token, r) for r, token in tokens.items()))
        own, own_role = (tokens[role], role) if role in tokens else (shared, None)
        if not config.tls:
            return cls(own, callers=callers, role=own_role)
        return cls(own, Path(config.tls_cert_file).read_bytes(), Path(config.tls_key_file).read_bytes(),
                   Path(config.tls_ca_file).read_bytes(), config.tls_server_name, callers, own_role)

    @property
    def tls(self) -> bool:
        return self.cert is not None

    @property
    def accepted(self) -> tuple[tuple[str, str], ...]:
        """The (token, role) pairs this process accepts as a server."""
        return self.callers or (((self.token, ANY),) if self.token else ())

    @property
    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call carries (empty without a token)."""
        if not self.token:
            return ()
        if self.role is None:
            return ((TOKEN_METADATA_KEY, f"Bearer {self.token}"),)
        return (TOKEN_METADATA_KEY, f"Bearer {self.token}"), (ROLE_METADATA_KEY, self.role)

    # ------------------------------------------------------------------ proving an engine's identity

    def prove(self, nonce: bytes, role: str, engine_id: str) -> bytes:
        """An engine's answer to a challenge from a caller whose token is of `role` ("" for the shared
        token): ValueError for a nonce out of bounds, LookupError when this process holds no such token."""
        low, high = IDENTITY_NONCE_BYTES
        if not low <= len(nonce) <= high:
            raise ValueError(f"nonce must be {low} to {high} bytes, got {len(nonce)}")
        wanted = role or ANY
        token = next((token for token, r in self.accepted if r == wanted), None)
        if token is None:
            raise LookupError(f"this engine holds no {role or 'shared'} token to prove itself with")
        return identity_proof(token, nonce, engine_id)

    def verifies(self, nonce: bytes, engine_id: str, proof: bytes) -> bool:
        """Whether `proof` is the answer to `nonce` of an engine that holds this process's token."""
        return self.token is not None and hmac.compare_digest(identity_proof(self.token, nonce, engine_id), proof)

    # ------------------------------------------------------------------ server side

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenInterceptor(self.accepted, self.refusals)] if self.accepted else []

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Listen on `address`: mTLS (client certificates required) or plain text."""
        if not self.tls:
            return server.add_insecure_port(address)
        credentials = grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                                  require_client_auth=True)
        return server.add_secure_port(address, credentials)

    def warn_if_open(self, what: str) -> None:
        if not self.accepted:
            logger.warning("%s is UNAUTHENTICATED: no internal token (--internal-token-file, a role's token file "
                           "or $%s), so anyone who reaches its port may call it", what, TOKEN_ENV)

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

    def authorize(self, sent: str, method: str) -> grpc.StatusCode | None:
        """None when the token `sent` (bare, without "Bearer ") may call `method` (always, for a
        process that accepts no token); else UNAUTHENTICATED (no token it knows) or
        PERMISSION_DENIED (a role that may not). Counts and logs a refusal."""
        if not self.accepted:
            return None
        code = _authorize(None, _role_of(f"Bearer {sent}".encode(), _expected(self.accepted)), method)
        if code is not None:
            self.refusals.refuse(method.lstrip("/").rpartition("/")[0], code, method)
        return code

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


def _expected(accepted: Sequence[tuple[str, str]]) -> tuple[tuple[bytes, str], ...]:
    return tuple((f"Bearer {token}".encode(), role) for token, role in accepted)


def _role_of(sent: bytes | None, expected: Sequence[tuple[bytes, str]]) -> str | None:
    """The role whose `Bearer <token>` `sent` is, comparing with every known token in constant time
    (no early exit: the time taken tells nothing of which one, if any, matched)."""
    role = None
    for value, candidate in expected:
        if hmac.compare_digest(sent or b"", value):
            role = candidate
    return role if sent is not None else None


def _authorize(claimed: str | None, role: str | None, method: str) -> grpc.StatusCode | None:
    """`claimed`: the role the caller said (None: none said); `role`: its token's (None: unknown)."""
    if role is None or claimed not in (None, role) and role != ANY:
        return grpc.StatusCode.UNAUTHENTICATED
    return None if role in callers_of(method) else grpc.StatusCode.PERMISSION_DENIED


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Ends every call without a known token UNAUTHENTICATED, and every call from a role that may
    not call its method PERMISSION_DENIED, before its handler runs and without parsing its message;
    the health service is open. `accepted`: (token, role) pairs."""

    def __init__(self, accepted: Sequence[tuple[str, str]], refusals: Refusals | None = None) -> None:
        self._expected = _expected(accepted)
        self._callers: dict[str, frozenset[str]] = {}  # callers_of, by method
        self.refusals = refusals or Refusals()
        self._refusing: dict[tuple[str, grpc.StatusCode], grpc.RpcMethodHandler] = {}  # one per registered method

    def role_of(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """The role of the caller's token (None: no token, or none this server knows)."""
        sent = next((value for key, value in metadata or () if key == TOKEN_METADATA_KEY), None)
        return _role_of(sent.encode() if isinstance(sent, str) else sent, self._expected)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = handler_call_details.invocation_metadata
        claimed = next((value for key, value in metadata or () if key == ROLE_METADATA_KEY), None)
        allowed = self._callers.get(method)
        if allowed is None:
            allowed = self._callers[method] = callers_of(method)
        if claimed is not None and claimed not in allowed:  # refused without comparing a token
            code = grpc.StatusCode.PERMISSION_DENIED
        else:
            code = _authorize(claimed, self.role_of(metadata), method)
        if code is None:
            return handler
        self.refusals.refuse(method.lstrip("/").rpartition("/")[0], code, method)
        refusing = self._refusing.get((method, code))
        if refusing is None:
            refusing = self._refusing[method, code] = _refusing(handler, code, method)
        return refusing


def _refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses the call with `code`, its message left
    unparsed (raw bytes: a refusal costs no deserialization)."""
    details = UNAUTHENTICATED_MESSAGE if code == grpc.StatusCode.UNAUTHENTICATED else \
        PERMISSION_DENIED_MESSAGE.format(method=method)

    async def refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, details)

    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[(handler.request_streaming,
                                                                 handler.response_streaming)]
    return make(refuse, request_deserializer=None, response_serializer=handler.response_serializer)


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
