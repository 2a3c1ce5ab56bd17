from services.common.rpc.kvmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVTransfer(_message.Message):
    __slots__ = ("peer", "block_ids", "tag")
    PEER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    peer: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    tag: int
    def __init__(self, peer: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., tag: _Optional[int] = ...) -> None: ...

class KVTransferDone(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model_id", "model_path", "vocab_size", "max_model_len", "block_size", "rank", "world_size", "kv_transfer_endpoint", "step_port")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    STEP_PORT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_path: str
    vocab_size: int
    max_model_len: int
    block_size: int
    rank: int
    world_size: int
    kv_transfer_endpoint: str
    step_port: int
    def __init__(self, model_id: _Optional[str] = ..., model_path: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., kv_transfer_endpoint: _Optional[str] = ..., step_port: _Optional[int] = ...) -> None: ...

class StepChannelHello(_message.Message):
    __slots__ = ("version", "token", "session")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    token: str
    session: str
    def __init__(self, version: _Optional[int] = ..., token: _Optional[str] = ..., session: _Optional[str] = ...) -> None: ...

class StepChannelError(_message.Message):
    __slots__ = ("code", "details")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class InitializeCacheRequest(_message.Message):
    __slots__ = ("max_num_reqs",)
    MAX_NUM_REQS_FIELD_NUMBER: _ClassVar[int]
    max_num_reqs: int
    def __init__(self, max_num_reqs: _Optional[int] = ...) -> None: ...

class InitializeCacheResponse(_message.Message):
    __slots__ = ("num_blocks",)
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ...) -> None: ...

class NewRequestData(_message.Message):
    __slots__ = ("req_id", "prompt_token_ids", "output_token_ids", "sampling_params", "stop_token_ids", "block_ids", "num_computed_tokens", "lora_request")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_computed_tokens: int
    lora_request: LoRARequest
    def __init__(self, req_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., output_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_computed_tokens: _Optional[int] = ..., lora_request: _Optional[_Union[LoRARequest, _Mapping]] = ...) -> None: ...

class LoRARequest(_message.Message):
    __slots__ = ("lora_name", "lora_int_id", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_INT_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_int_id: int
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_int_id: _Optional[int] = ..., lora_path: _Optional[str] = ...) -> None: ...

class CachedRequests(_message.Message):
    __slots__ = ("req_ids", "num_computed_tokens", "num_new_blocks", "new_block_ids")
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_NEW_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_computed_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_new_blocks: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., num_computed_tokens: _Optional[_Iterable[int]] = ..., num_new_blocks: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SchedulerOutput(_message.Message):
    __slots__ = ("scheduled_new_reqs", "scheduled_cached_reqs", "scheduled_req_ids", "num_scheduled_tokens", "total_num_scheduled_tokens", "finished_req_ids", "num_preempted", "grammar_req_ids", "grammar_bitmask", "removed_lora_ids", "spec_req_ids", "num_spec_tokens", "spec_token_ids")
    SCHEDULED_NEW_REQS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_CACHED_REQS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_NUM_SCHEDULED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTED_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_BITMASK_FIELD_NUMBER: _ClassVar[int]
    REMOVED_LORA_IDS_FIELD_NUMBER: _ClassVar[int]
    SPEC_REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    scheduled_new_reqs: _containers.RepeatedCompositeFieldContainer[NewRequestData]
    scheduled_cached_reqs: CachedRequests
    scheduled_req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_scheduled_tokens: _containers.RepeatedScalarFieldContainer[int]
    total_num_scheduled_tokens: int
    finished_req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_preempted: int
    grammar_req_ids: _containers.RepeatedScalarFieldContainer[str]
    grammar_bitmask: bytes
    removed_lora_ids: _containers.RepeatedScalarFieldContainer[int]
    spec_req_ids: _containers.RepeatedScalarFieldContainer[str]
    num_spec_tokens: _containers.RepeatedScalarFieldContainer[int]
    spec_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, scheduled_new_reqs: _Optional[_Iterable[_Union[NewRequestData, _Mapping]]] = ..., scheduled_cached_reqs: _Optional[_Union[CachedRequests, _Mapping]] = ..., scheduled_req_ids: _Optional[_Iterable[str]] = ..., num_scheduled_tokens: _Optional[_Iterable[int]] = ..., total_num_scheduled_tokens: _Optional[int] = ..., finished_req_ids: _Optional[_Iterable[str]] = ..., num_preempted: _Optional[int] = ..., grammar_req_ids: _Optional[_Iterable[str]] = ..., grammar_bitmask: _Optional[bytes] = ..., removed_lora_ids: _Optional[_Iterable[int]] = ..., spec_req_ids: _Optional[_Iterable[str]] = ..., num_spec_tokens: _Optional[_Iterable[int]] = ..., spec_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelRunnerOutput(_message.Message):
    __slots__ = ("req_ids", "sampled_token_ids", "logprobs", "prompt_logprobs", "failed", "num_accepted_drafts")
    class PromptLogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: _common_pb2.TokenLogprobsList
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.TokenLogprobsList, _Mapping]] = ...) -> None: ...
    class FailedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQ_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    req_ids: _containers.RepeatedScalarFieldContainer[str]
    sampled_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    prompt_logprobs: _containers.MessageMap[str, _common_pb2.TokenLogprobsList]
    failed: _containers.ScalarMap[str, str]
    num_accepted_drafts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req_ids: _Optional[_Iterable[str]] = ..., sampled_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Mapping[str, _common_pb2.TokenLogprobsList]] = ..., failed: _Optional[_Mapping[str, str]] = ..., num_accepted_drafts: _Optional[_Iterable[int]] = ...) -> None: ...
