from services.common.rpc.kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EngineRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "priority", "cache_salt", "group_id", "prefill_engine_address", "tenant_id", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ENGINE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TENANT_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    cache_salt: str
    group_id: str
    prefill_engine_address: str
    tenant_id: str
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., cache_salt: _Optional[str] = ..., group_id: _Optional[str] = ..., prefill_engine_address: _Optional[str] = ..., tenant_id: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request", "receiver_endpoints", "first_block", "block_ids", "tag")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    request: EngineRequest
    receiver_endpoints: _containers.RepeatedScalarFieldContainer[str]
    first_block: int
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    tag: int
    def __init__(self, request: _Optional[_Union[EngineRequest, _Mapping]] = ..., receiver_endpoints: _Optional[_Iterable[str]] = ..., first_block: _Optional[int] = ..., block_ids: _Optional[_Iterable[int]] = ..., tag: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprobs", "num_cached_tokens", "sent", "bytes_sent")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    num_cached_tokens: int
    sent: bool
    bytes_sent: int
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., sent: _Optional[bool] = ..., bytes_sent: _Optional[int] = ...) -> None: ...

class ReleaseTransferRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class ReleaseTransferResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineOutput(_message.Message):
    __slots__ = ("request_id", "new_token_ids", "new_logprobs", "new_prompt_logprobs", "finish_reason", "stop_token_id", "stop_string", "num_cached_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEW_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    new_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    new_prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reason: str
    stop_token_id: int
    stop_string: str
    num_cached_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., new_token_ids: _Optional[_Iterable[int]] = ..., new_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., new_prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "num_used_blocks", "num_total_blocks", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "lora")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    num_used_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    lora: LoRAState
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_used_blocks: _Optional[int] = ..., num_total_blocks: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., lora: _Optional[_Union[LoRAState, _Mapping]] = ...) -> None: ...

class LoRAState(_message.Message):
    __slots__ = ("adapters", "running", "waiting", "loaded", "max_loras", "num_deferred")
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    NUM_DEFERRED_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedScalarFieldContainer[str]
    running: _containers.RepeatedScalarFieldContainer[str]
    waiting: _containers.RepeatedScalarFieldContainer[str]
    loaded: _containers.RepeatedScalarFieldContainer[str]
    max_loras: int
    num_deferred: int
    def __init__(self, adapters: _Optional[_Iterable[str]] = ..., running: _Optional[_Iterable[str]] = ..., waiting: _Optional[_Iterable[str]] = ..., loaded: _Optional[_Iterable[str]] = ..., max_loras: _Optional[int] = ..., num_deferred: _Optional[int] = ...) -> None: ...

class LoadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoRAAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UnloadLoRAAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoRAAdapterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetEngineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineInfo(_message.Message):
    __slots__ = ("model_id", "model_path", "max_model_len", "block_size", "engine_id", "epoch", "role", "kv_transfer_endpoints", "model_name")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_path: str
    max_model_len: int
    block_size: int
    engine_id: str
    epoch: int
    role: str
    kv_transfer_endpoints: _containers.RepeatedScalarFieldContainer[str]
    model_name: str
    def __init__(self, model_id: _Optional[str] = ..., model_path: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., engine_id: _Optional[str] = ..., epoch: _Optional[int] = ..., role: _Optional[str] = ..., kv_transfer_endpoints: _Optional[_Iterable[str]] = ..., model_name: _Optional[str] = ...) -> None: ...

class IdentityChallenge(_message.Message):
    __slots__ = ("nonce", "role")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    role: str
    def __init__(self, nonce: _Optional[bytes] = ..., role: _Optional[str] = ...) -> None: ...

class IdentityProof(_message.Message):
    __slots__ = ("engine_id", "proof")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    proof: bytes
    def __init__(self, engine_id: _Optional[str] = ..., proof: _Optional[bytes] = ...) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("num_matched_blocks", "num_running", "num_waiting", "num_free_blocks", "kv_cache_usage")
    NUM_MATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    num_matched_blocks: int
    num_running: int
    num_waiting: int
    num_free_blocks: int
    kv_cache_usage: float
    def __init__(self, num_matched_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ...) -> None: ...
