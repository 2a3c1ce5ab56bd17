"""Which engine holds which cached KV block: one interface (`PrefixIndex`), an in-memory and a Redis
implementation, and the engines asked directly (read-only). Fed only from the engines' KV events; read
by the router."""

from services.prefix_index.engines_index import EnginesPrefixIndex
from services.prefix_index.index import EngineLoad, EngineState, PrefixIndex, StaleEpochError
from services.prefix_index.memory import MemoryPrefixIndex
from services.prefix_index.redis_index import RedisPrefixIndex
from services.prefix_index.replica import PrefixIndexReplica

__all__ = [
    "EngineLoad",
    "EngineState",
    "EnginesPrefixIndex",
    "MemoryPrefixIndex",
    "PrefixIndex",
    "PrefixIndexReplica",
    "RedisPrefixIndex",
    "StaleEpochError",
]
