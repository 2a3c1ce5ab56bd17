"""The prefix index in Redis, shared by every processor and engine of a deployment.

Schema (docs/features/prefix_index.md has the costs): with `ns` the namespace and `id` an engine id,

    {ns}:b:<hash>      SET     "id:epoch" of each engine holding the block (<hash>: the 32 raw bytes)
    {ns}:e:<id>:blocks SET     the block hashes the engine's current epoch holds (the reverse set)
    {ns}:e:<id>:epoch  STRING  the engine's current epoch (no TTL: refuses a dead incarnation's updates)
    {ns}:e:<id>:live   HASH    epoch + last load, with a TTL of heartbeat_ttl_s: the engine is alive
    {ns}:engines       SET     every engine id that has any key above (what `sweep` walks)
    {ns}:events        STREAM  every change to the blocks above, in order (what replicas follow:
                               services/prefix_index/replica.py), capped at about EVENTS_MAXLEN entries

Every update is one Lua script (atomic); a lookup is one script too (one round trip) that walks the
chain and stops at the first block no live engine still matching holds. The scripts name keys they
build themselves, so this needs a single Redis (or a replica set), not Redis Cluster.

Redis is not trusted to hold honest epochs: a stored epoch refuses an older incarnation only while a
heartbeat keeps it alive (its live key names it, with a TTL no longer than the caller's heartbeat
TTL). Garbage, or an epoch no one heartbeats, is overwritten by the next engine that writes. So a
forged epoch silences an engine for one heartbeat TTL at most, and the publisher retries meanwhile.

Access (RedisAccess): a password read from a file, an ACL user, TLS files; the commands the client
and the scripts send are REDIS_ACL_COMMANDS, all on keys under the namespace (redis_acl_rule).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.asyncio.retry import Retry

from services.common.config import PrefixIndexConfig
from services.common.hashing import BLOCK_HASH_BYTES as HASH_BYTES
from services.common.hashing import BlockHash
from services.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, CacheSnapshot, KVCacheEvent
from services.prefix_index.index import EngineLoad, EngineState, StaleEpochError, validate_engine

logger = logging.getLogger(__name__)

# Every command kvmesh sends to Redis: the client's own (ping at start, the scripts by sha and their
# load, the replica's reads and engines()), then those the Lua scripts below call. An ACL user
# allowed these on keys under the namespace, and nothing else, is all kvmesh needs.
REDIS_CLIENT_COMMANDS = ("ping", "evalsha", "script|load", "smembers", "hgetall", "xread", "xrevrange")
REDIS_SCRIPT_COMMANDS = ("get", "set", "del", "exists", "sadd", "srem", "smembers", "scard", "hset", "hget",
                         "pexpire", "pttl", "xadd", "xrevrange")
REDIS_ACL_COMMANDS = tuple(dict.fromkeys(REDIS_CLIENT_COMMANDS + REDIS_SCRIPT_COMMANDS))
MAX_EPOCH_DIGITS = 20  # an epoch is a non-negative int64 (a start time in ns): longer ones are forged

# The events stream keeps about this many entries (XADD MAXLEN ~): a replica that falls further
# behind than that reloads a snapshot.
EVENTS_MAXLEN = 10_000

# Shared by the scripts: `newer` compares decimal epochs as strings (Lua numbers are doubles and lose
# nanosecond timestamps); `purge` drops everything engine `id` published, O(its blocks).
_LUA_COMMON = """
local function newer(a, b)
  if #a ~= #b then return #a > #b end
  return a > b
end
local function purge(ns, id, ...)
  local rkey = ns .. ':e:' .. id .. ':blocks'
  local members = {}
  for i, epoch in ipairs({...}) do members[i] = id .. ':' .. epoch end
  for _, h in ipairs(redis.call('SMEMBERS', rkey)) do
    redis.call('SREM', ns .. ':b:' .. h, unpack(members))
  end
  redis.call('DEL', rkey)
end
-- Whether `current`, the epoch stored for engine `id`, is a live incarnation's: decimal, and named
-- by the live key, whose TTL a heartbeat of at most `ttl` ms set. Anything else was forged or is dead.
local function credible(ns, id, current, ttl)
  if #current > MAX_EPOCH_DIGITS or not string.match(current, '^%d+$') then return false end
  local lkey = ns .. ':e:' .. id .. ':live'
  if redis.call('HGET', lkey, 'epoch') ~= current then return false end
  local left = redis.call('PTTL', lkey)
  return left > 0 and left <= tonumber(ttl)
end
-- One stream entry: `prev` (the id of the entry before it: a replica that did not read that one
-- missed some and reloads), the engine and epoch, then its ops as fields '<i><op>' = concatenated
-- 32-byte hashes ('S' stored, 'R' removed, 'C' all cleared, 'F' engine forgotten).
local function publish(ns, id, epoch, ops)
  local skey = ns .. ':events'
  local last = redis.call('XREVRANGE', skey, '+', '-', 'COUNT', 1)
  local prev = ''
  if #last > 0 then prev = last[1][1] end
  local entry = {skey, 'MAXLEN', '~', ARGV_MAXLEN, '*', 'prev', prev, 'id', id, 'epoch', epoch}
  for i, op in ipairs(ops) do
    entry[#entry + 1] = i .. op[1]
    entry[#entry + 1] = op[2]
  end
  redis.call('XADD', unpack(entry))
end
-- Forgetting the last engine deletes the stream too: nothing is left under ns.
local function forget(ns, id)
  publish(ns, id, '0', {{'F', ''}})
  local epoch = redis.call('GET', ns .. ':e:' .. id .. ':epoch')
  if epoch then purge(ns, id, epoch) end
  redis.call('DEL', ns .. ':e:' .. id .. ':epoch', ns .. ':e:' .. id .. ':live', ns .. ':e:' .. id .. ':blocks')
  redis.call('SREM', ns .. ':engines', id)
  if redis.call('SCARD', ns .. ':engines') == 0 then redis.call('DEL', ns .. ':events') end
end
""".replace("ARGV_MAXLEN", str(EVENTS_MAXLEN)).replace("MAX_EPOCH_DIGITS", str(MAX_EPOCH_DIGITS))

# ARGV: ns, id, epoch, ttl_ms, then ops: 'S' n h1..hn (stored), 'R' n h1..hn (removed), 'C' (all
# cleared), 'L' running waiting free_blocks kv_usage (load). Returns 1 if this epoch of the engine was
# in the index before the call, 0 if the call (re)created it. A stored epoch other than the caller's
# is dropped, with the blocks of both, unless it is a newer live one (STALE_EPOCH).
_APPLY = _LUA_COMMON + """
local ns, id, epoch, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ekey = ns .. ':e:' .. id .. ':epoch'
local lkey = ns .. ':e:' .. id .. ':live'
local rkey = ns .. ':e:' .. id .. ':blocks'
local current = redis.call('GET', ekey)
local known = current == epoch
if current and not known then
  if credible(ns, id, current, ttl) and newer(current, epoch) then
    return redis.error_reply('STALE_EPOCH ' .. id .. ': epoch ' .. epoch .. ' is older than the live ' .. current)
  end
  purge(ns, id, current, epoch)
  redis.call('DEL', lkey)
end
redis.call('SET', ekey, epoch)
redis.call('SADD', ns .. ':engines', id)
local member = id .. ':' .. epoch
local published = {}  -- the block ops, for the events stream
local i = 5
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'C' then
    purge(ns, id, epoch)
    published[#published + 1] = {'C', ''}
    i = i + 1
  elseif op == 'L' then
    redis.call('HSET', lkey, 'running', ARGV[i + 1], 'waiting', ARGV[i + 2],
               'free_blocks', ARGV[i + 3], 'kv_usage', ARGV[i + 4])
    i = i + 5
  else
    local n = tonumber(ARGV[i + 1])
    published[#published + 1] = {op, table.concat(ARGV, '', i + 2, i + 1 + n)}
    for j = i + 2, i + 1 + n do
      local h = ARGV[j]
      if op == 'S' then
        redis.call('SADD', ns .. ':b:' .. h, member)
        redis.call('SADD', rkey, h)
      elseif redis.call('SREM', rkey, h) == 1 then
        redis.call('SREM', ns .. ':b:' .. h, member)
      end
    end
    i = i + 2 + n
  end
end
redis.call('HSET', lkey, 'epoch', epoch)
redis.call('PEXPIRE', lkey, ttl)
if #published > 0 or not known then publish(ns, id, epoch, published) end
if known then return 1 end
return 0
"""

# ARGV: ns. Returns {last event id, id1, epoch1, blocks1, id2, ...}: every engine's blocks with the id of
# the last event they include (a replica follows the stream from there).
_SNAPSHOT = """
local ns = ARGV[1]
local last = redis.call('XREVRANGE', ns .. ':events', '+', '-', 'COUNT', 1)
local out = {''}
if #last > 0 then out[1] = last[1][1] end
for _, id in ipairs(redis.call('SMEMBERS', ns .. ':engines')) do
  local epoch = redis.call('GET', ns .. ':e:' .. id .. ':epoch')
  if epoch then
    out[#out + 1] = id
    out[#out + 1] = epoch
    out[#out + 1] = table.concat(redis.call('SMEMBERS', ns .. ':e:' .. id .. ':blocks'))
  end
end
return out
"""

# ARGV: ns, h1..hn. Returns {id1, len1, id2, len2, ...}.
_LONGEST_PREFIX = """
local ns = ARGV[1]
local live = {}    -- id -> live epoch, or false when the engine's heartbeat expired
local matched = {} -- member -> blocks matched so far
local active = nil -- members that matched every block so far
for i = 2, #ARGV do
  local next_active = {}
  local any = false
  for _, m in ipairs(redis.call('SMEMBERS', ns .. ':b:' .. ARGV[i])) do
    if active == nil or active[m] then
      local id, epoch = string.match(m, '^(.*):(%d+)$')  -- nil for a member no engine wrote
      if id ~= nil and live[id] == nil then
        live[id] = redis.call('HGET', ns .. ':e:' .. id .. ':live', 'epoch')
      end
      if id ~= nil and live[id] == epoch then
        next_active[m] = true
        matched[m] = i - 1
        any = true
      end
    end
  end
  if not any then break end
  active = next_active
end
local out = {}
for m, n in pairs(matched) do
  out[#out + 1] = string.match(m, '^(.*):%d+$')
  out[#out + 1] = n
end
return out
"""

# ARGV: ns, id.
_CLEAR = _LUA_COMMON + """
forget(ARGV[1], ARGV[2])
return 1
"""

# ARGV: ns. Returns the ids it cleared.
_SWEEP = _LUA_COMMON + """
local ns = ARGV[1]
local gone = {}
for _, id in ipairs(redis.call('SMEMBERS', ns .. ':engines')) do
  if redis.call('EXISTS', ns .. ':e:' .. id .. ':live') == 0 then
    forget(ns, id)
    gone[#gone + 1] = id
  end
end
return gone
"""


@dataclass(frozen=True)
class RedisAccess:
    """How to reach and log in to the index's Redis: the URL, an ACL user, a password (read from a
    file at start, so it is never on a command line) and TLS files for a rediss:// URL."""

    url: str
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None

    @classmethod
    def load(cls, config: PrefixIndexConfig) -> RedisAccess:
        """From --prefix-index and its credential flags; ValueError naming the file (never its content)
        when the password file cannot be read or is empty."""
        if config.prefix_index is None:
            raise ValueError("no --prefix-index")
        password = None
        if config.prefix_index_password_file is not None:
            password = read_password_file(config.prefix_index_password_file)
        return cls(config.prefix_index, config.prefix_index_username, password, config.prefix_index_ca_file,
                   config.prefix_index_cert_file, config.prefix_index_key_file)

    def __repr__(self) -> str:  # never the password, neither the file's nor one inside the URL
        return f"RedisAccess({self.redacted_url!r}, username={self.username!r}, tls={self.url.startswith('rediss://')})"

    @property
    def redacted_url(self) -> str:
        """The URL with any password in it replaced by ***, for messages."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        return urlunsplit(parts._replace(netloc=netloc))

    def client(self, timeout_s: float) -> aioredis.Redis:
        """A client whose every call fails within about `timeout_s` (no retries). It sends no CLIENT
        SETINFO on connect: an ACL user limited to REDIS_ACL_COMMANDS may not."""
        credentials = {key: value for key, value in (("username", self.username), ("password", self.password))
                       if value is not None}
        tls = {"ssl_ca_certs": str(self.ca_file) if self.ca_file else None,
               "ssl_certfile": str(self.cert_file) if self.cert_file else None,
               "ssl_keyfile": str(self.key_file) if self.key_file else None} if self.url.startswith("rediss://") else {}
        return aioredis.Redis.from_url(
            self.url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
            decode_responses=False,
            driver_info=None,
            **credentials,
            **tls,
        )


def read_password_file(path: Path) -> str:
    try:
        password = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read --prefix-index-password-file {path}: {e.strerror or e}") from None
    if not password:
        raise ValueError(f"--prefix-index-password-file {path} is empty")
    return password


def redis_acl_rule(namespace: str = "kvmesh:pi", user: str = "kvmesh", password: str = "PASSWORD") -> str:
    """The ACL line (redis.conf `user ...`, or after `ACL SETUSER`) that allows kvmesh exactly what it
    sends, on keys under `namespace`, and no pub/sub channels."""
    return " ".join([f"user {user} on >{password} ~{namespace}:* resetchannels -@all",
                     *(f"+{command}" for command in REDIS_ACL_COMMANDS)])


class RedisPrefixIndex:
    """Raises ConnectionError (the builtin) when Redis cannot be reached or answer within the client's
    socket timeout; `connect` builds a client with short, bounded timeouts and no retries."""

    def __init__(
        self, client: aioredis.Redis, namespace: str = "kvmesh:pi", heartbeat_ttl_s: float = 10.0
    ) -> None:
        if heartbeat_ttl_s <= 0:
            raise ValueError(f"heartbeat_ttl_s must be positive, got {heartbeat_ttl_s}")
        if not namespace:
            raise ValueError("namespace must not be empty")
        self.namespace = namespace
        self.heartbeat_ttl_ms = max(1, round(heartbeat_ttl_s * 1000))
        self._client = client
        self._apply = client.register_script(_APPLY)
        self._longest_prefix = client.register_script(_LONGEST_PREFIX)
        self._snapshot = client.register_script(_SNAPSHOT)
        self._clear = client.register_script(_CLEAR)
        self._sweep = client.register_script(_SWEEP)

    @classmethod
    def connect(
        cls, url: str | RedisAccess, timeout_s: float = 0.5, namespace: str = "kvmesh:pi",
        heartbeat_ttl_s: float = 10.0
    ) -> RedisPrefixIndex:
        """An index over `url` (redis://host:port/db, or a RedisAccess with credentials) whose every
        call fails within about `timeout_s`."""
        return cls(redis_client(url, timeout_s), namespace, heartbeat_ttl_s)

    async def check_access(self, where: str) -> None:
        """At start: PermissionError when Redis refuses our credentials (NOAUTH, WRONGPASS, NOPERM) or
        its TLS certificate, so a misconfigured pod fails at once with the reason. An unreachable
        Redis is only logged: the index is optional, and it may come up later."""
        try:
            await self._client.ping()
        except (AuthenticationError, NoPermissionError) as e:
            raise PermissionError(f"prefix index: Redis at {where} refused kvmesh's credentials "
                                  f"(--prefix-index-username, --prefix-index-password-file): {e}") from None
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            if isinstance(e.__cause__ or e.__context__, ssl.SSLError):
                raise PermissionError(f"prefix index: TLS with Redis at {where} failed "
                                      f"(--prefix-index-ca-file, --prefix-index-cert-file): {e}") from None
            logger.warning("prefix index: Redis at %s is unreachable for now (%s); routing by load until it answers",
                           where, e)

    async def _run(self, script: AsyncScript, args: list[bytes | str | int]) -> list:
        try:
            return await script(keys=[], args=args)
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise ConnectionError(f"prefix index: Redis unreachable: {e}") from e

    async def _update(self, engine_id: str, epoch: int, ops: list[bytes | str | int]) -> bool:
        validate_engine(engine_id, epoch)
        args = [self.namespace, engine_id, epoch, self.heartbeat_ttl_ms, *ops]
        try:
            return bool(await self._run(self._apply, args))
        except ResponseError as e:
            if "STALE_EPOCH" in str(e):
                raise StaleEpochError(str(e).split("STALE_EPOCH ", 1)[-1]) from e
            raise

    async def apply(self, engine_id: str, epoch: int, events: Sequence[KVCacheEvent]) -> bool:
        ops: list[bytes | str | int] = []
        for event in events:
            if isinstance(event, CacheSnapshot):
                ops.append("C")  # then stored, in the same script: the swap is atomic
            if isinstance(event, (BlockStored, BlockRemoved, CacheSnapshot)):
                if any(len(h) != HASH_BYTES for h in event.block_hashes):
                    raise ValueError(f"block hashes must be {HASH_BYTES} bytes: {event!r}")
                op = "R" if isinstance(event, BlockRemoved) else "S"
                ops += [op, len(event.block_hashes), *event.block_hashes]
            elif isinstance(event, AllBlocksCleared):
                ops.append("C")
            else:
                raise TypeError(f"not a KV cache event: {event!r}")
        return await self._update(engine_id, epoch, ops)

    async def heartbeat(self, engine_id: str, epoch: int, load: EngineLoad) -> bool:
        ops = ["L", load.num_running, load.num_waiting, load.num_free_blocks, repr(load.kv_cache_usage)]
        return await self._update(engine_id, epoch, ops)

    async def snapshot(self) -> tuple[bytes, dict[str, tuple[int, list[BlockHash]]]]:
        """Every engine's epoch and blocks, and the id of the last entry of the events stream they
        include (b"" when the stream is empty), read atomically."""
        flat = await self._run(self._snapshot, [self.namespace])
        engines = {flat[i].decode(): (int(flat[i + 1]), split_hashes(flat[i + 2])) for i in range(1, len(flat), 3)
                   if valid_epoch(flat[i + 1])}  # a forged epoch's engine is left out until it writes again
        return flat[0], engines

    async def longest_prefix(self, block_hashes: Sequence[BlockHash]) -> dict[str, int]:
        if not block_hashes:
            return {}
        flat = await self._run(self._longest_prefix, [self.namespace, *block_hashes])
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def engines(self) -> dict[str, EngineState]:
        ns = self.namespace
        try:
            ids = sorted(m.decode() for m in await self._client.smembers(f"{ns}:engines"))
            async with self._client.pipeline(transaction=False) as pipe:
                for engine_id in ids:
                    pipe.hgetall(f"{ns}:e:{engine_id}:live")
                states = await pipe.execute()
        except (RedisConnectionError, RedisTimeoutError, OSError) as e:
            raise ConnectionError(f"prefix index: Redis unreachable: {e}") from e
        live = {engine_id: _engine_state(state) for engine_id, state in zip(ids, states) if state}
        return {engine_id: state for engine_id, state in live.items() if state is not None}

    async def clear(self, engine_id: str) -> None:
        await self._run(self._clear, [self.namespace, engine_id])

    async def sweep(self) -> list[str]:
        return sorted(m.decode() for m in await self._run(self._sweep, [self.namespace]))

    async def close(self) -> None:
        await self._client.aclose()


def redis_client(url: str | RedisAccess, timeout_s: float) -> aioredis.Redis:
    """A client for `url` whose every call fails within about `timeout_s` (no retries)."""
    return (url if isinstance(url, RedisAccess) else RedisAccess(url)).client(timeout_s)


def valid_epoch(text: bytes) -> bool:
    """Whether `text` is an epoch an engine could have written (Redis may hold anything)."""
    return text.isdigit() and len(text) <= MAX_EPOCH_DIGITS


def split_hashes(packed: bytes) -> list[BlockHash]:
    """Concatenated block hashes (how the scripts pack them), split."""
    if len(packed) % HASH_BYTES:
        raise ValueError(f"{len(packed)} bytes is not a whole number of {HASH_BYTES}-byte block hashes")
    return [packed[i:i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES)]


def _engine_state(state: dict[bytes, bytes]) -> EngineState | None:
    """A live hash as the engine wrote it; None for one it could not have written (forged)."""
    if not valid_epoch(state.get(b"epoch", b"")):
        return None
    epoch = int(state[b"epoch"])
    if b"running" not in state:
        return EngineState(epoch, None)
    try:
        load = EngineLoad(
            int(state[b"running"]), int(state[b"waiting"]), int(state[b"free_blocks"]), float(state[b"kv_usage"])
        )
    except (KeyError, ValueError):
        return None
    return EngineState(epoch, load)
