from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_CURRENT: _ClassVar[ProtocolVersion]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3FN: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]

class ComponentType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPONENT_TYPE_UNSPECIFIED: _ClassVar[ComponentType]
    COMPONENT_TYPE_KV: _ClassVar[ComponentType]
    COMPONENT_TYPE_SWA: _ClassVar[ComponentType]
    COMPONENT_TYPE_SWA_RING: _ClassVar[ComponentType]
    COMPONENT_TYPE_C128_STATE: _ClassVar[ComponentType]
    COMPONENT_TYPE_AUX: _ClassVar[ComponentType]

class IndexKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INDEX_KIND_UNSPECIFIED: _ClassVar[IndexKind]
    INDEX_KIND_KV_PAGES: _ClassVar[IndexKind]
    INDEX_KIND_SWA_PAGES: _ClassVar[IndexKind]
    INDEX_KIND_SWA_RING_ROWS: _ClassVar[IndexKind]
    INDEX_KIND_REQ_SLOT: _ClassVar[IndexKind]
    INDEX_KIND_C128_STATE: _ClassVar[IndexKind]

class PoolName(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_NAME_UNSPECIFIED: _ClassVar[PoolName]
    POOL_NAME_TARGET: _ClassVar[PoolName]
    POOL_NAME_DRAFT: _ClassVar[PoolName]

class TransportKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_KIND_UNSPECIFIED: _ClassVar[TransportKind]
    TRANSPORT_KIND_RDMA: _ClassVar[TransportKind]
    TRANSPORT_KIND_TCP: _ClassVar[TransportKind]

class RejectReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REJECT_REASON_UNSPECIFIED: _ClassVar[RejectReason]
    REJECT_REASON_INCOMPATIBLE_POOLS: _ClassVar[RejectReason]
    REJECT_REASON_PROTOCOL_VERSION: _ClassVar[RejectReason]
    REJECT_REASON_ROLE_CONFLICT: _ClassVar[RejectReason]
    REJECT_REASON_INVALID_METADATA: _ClassVar[RejectReason]

class TransferState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_STATE_UNSPECIFIED: _ClassVar[TransferState]
    TRANSFER_STATE_BOOTSTRAPPING: _ClassVar[TransferState]
    TRANSFER_STATE_WAITING_FOR_INPUT: _ClassVar[TransferState]
    TRANSFER_STATE_TRANSFERRING: _ClassVar[TransferState]
    TRANSFER_STATE_SUCCESS: _ClassVar[TransferState]
    TRANSFER_STATE_FAILED: _ClassVar[TransferState]

class FailureReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAILURE_REASON_UNSPECIFIED: _ClassVar[FailureReason]
    FAILURE_REASON_ABORTED: _ClassVar[FailureReason]
    FAILURE_REASON_TIMEOUT: _ClassVar[FailureReason]
    FAILURE_REASON_PEER_FAILED: _ClassVar[FailureReason]
    FAILURE_REASON_PEER_UNREACHABLE: _ClassVar[FailureReason]
    FAILURE_REASON_TRANSPORT_ERROR: _ClassVar[FailureReason]
    FAILURE_REASON_INCOMPATIBLE: _ClassVar[FailureReason]
    FAILURE_REASON_INTEGRITY: _ClassVar[FailureReason]
    FAILURE_REASON_INVALID_REQUEST: _ClassVar[FailureReason]
    FAILURE_REASON_SHUTDOWN: _ClassVar[FailureReason]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_CURRENT: ProtocolVersion
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
DTYPE_UNSPECIFIED: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT16: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT8_E4M3FN: DType
DTYPE_UINT8: DType
COMPONENT_TYPE_UNSPECIFIED: ComponentType
COMPONENT_TYPE_KV: ComponentType
COMPONENT_TYPE_SWA: ComponentType
COMPONENT_TYPE_SWA_RING: ComponentType
COMPONENT_TYPE_C128_STATE: ComponentType
COMPONENT_TYPE_AUX: ComponentType
INDEX_KIND_UNSPECIFIED: IndexKind
INDEX_KIND_KV_PAGES: IndexKind
INDEX_KIND_SWA_PAGES: IndexKind
INDEX_KIND_SWA_RING_ROWS: IndexKind
INDEX_KIND_REQ_SLOT: IndexKind
INDEX_KIND_C128_STATE: IndexKind
POOL_NAME_UNSPECIFIED: PoolName
POOL_NAME_TARGET: PoolName
POOL_NAME_DRAFT: PoolName
TRANSPORT_KIND_UNSPECIFIED: TransportKind
TRANSPORT_KIND_RDMA: TransportKind
TRANSPORT_KIND_TCP: TransportKind
REJECT_REASON_UNSPECIFIED: RejectReason
REJECT_REASON_INCOMPATIBLE_POOLS: RejectReason
REJECT_REASON_PROTOCOL_VERSION: RejectReason
REJECT_REASON_ROLE_CONFLICT: RejectReason
REJECT_REASON_INVALID_METADATA: RejectReason
TRANSFER_STATE_UNSPECIFIED: TransferState
TRANSFER_STATE_BOOTSTRAPPING: TransferState
TRANSFER_STATE_WAITING_FOR_INPUT: TransferState
TRANSFER_STATE_TRANSFERRING: TransferState
TRANSFER_STATE_SUCCESS: TransferState
TRANSFER_STATE_FAILED: TransferState
FAILURE_REASON_UNSPECIFIED: FailureReason
FAILURE_REASON_ABORTED: FailureReason
FAILURE_REASON_TIMEOUT: FailureReason
FAILURE_REASON_PEER_FAILED: FailureReason
FAILURE_REASON_PEER_UNREACHABLE: FailureReason
FAILURE_REASON_TRANSPORT_ERROR: FailureReason
FAILURE_REASON_INCOMPATIBLE: FailureReason
FAILURE_REASON_INTEGRITY: FailureReason
FAILURE_REASON_INVALID_REQUEST: FailureReason
FAILURE_REASON_SHUTDOWN: FailureReason

class PoolGeometry(_message.Message):
    __slots__ = ("compression_ratios", "unified_kv", "sliding_window", "swa_ring_size", "swa_pages", "page_size", "head_dim", "indexer_head_dim", "dtype", "num_draft_tokens", "online_c128", "c4_ring_size", "c128_ring_size", "swa_pages_per_req", "num_req_slots", "max_context_len", "swa_index_mapping", "kind", "num_kv_heads", "inner_layout", "tp_rank", "tp_size")
    COMPRESSION_RATIOS_FIELD_NUMBER: _ClassVar[int]
    UNIFIED_KV_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    SWA_RING_SIZE_FIELD_NUMBER: _ClassVar[int]
    SWA_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    INDEXER_HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ONLINE_C128_FIELD_NUMBER: _ClassVar[int]
    C4_RING_SIZE_FIELD_NUMBER: _ClassVar[int]
    C128_RING_SIZE_FIELD_NUMBER: _ClassVar[int]
    SWA_PAGES_PER_REQ_FIELD_NUMBER: _ClassVar[int]
    NUM_REQ_SLOTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    SWA_INDEX_MAPPING_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    INNER_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    compression_ratios: _containers.RepeatedScalarFieldContainer[int]
    unified_kv: bool
    sliding_window: int
    swa_ring_size: int
    swa_pages: int
    page_size: int
    head_dim: int
    indexer_head_dim: int
    dtype: DType
    num_draft_tokens: int
    online_c128: bool
    c4_ring_size: int
    c128_ring_size: int
    swa_pages_per_req: int
    num_req_slots: int
    max_context_len: int
    swa_index_mapping: str
    kind: str
    num_kv_heads: int
    inner_layout: str
    tp_rank: int
    tp_size: int
    def __init__(self, compression_ratios: _Optional[_Iterable[int]] = ..., unified_kv: _Optional[bool] = ..., sliding_window: _Optional[int] = ..., swa_ring_size: _Optional[int] = ..., swa_pages: _Optional[int] = ..., page_size: _Optional[int] = ..., head_dim: _Optional[int] = ..., indexer_head_dim: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., num_draft_tokens: _Optional[int] = ..., online_c128: _Optional[bool] = ..., c4_ring_size: _Optional[int] = ..., c128_ring_size: _Optional[int] = ..., swa_pages_per_req: _Optional[int] = ..., num_req_slots: _Optional[int] = ..., max_context_len: _Optional[int] = ..., swa_index_mapping: _Optional[str] = ..., kind: _Optional[str] = ..., num_kv_heads: _Optional[int] = ..., inner_layout: _Optional[str] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., nbytes: _Optional[int] = ...) -> None: ...

class Buffer(_message.Message):
    __slots__ = ("name", "tensor", "offset", "nbytes", "item_len", "index_kind")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    ITEM_LEN_FIELD_NUMBER: _ClassVar[int]
    INDEX_KIND_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: int
    offset: int
    nbytes: int
    item_len: int
    index_kind: IndexKind
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., item_len: _Optional[int] = ..., index_kind: _Optional[_Union[IndexKind, str]] = ...) -> None: ...

class Component(_message.Message):
    __slots__ = ("name", "pool", "type", "buffers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    pool: PoolName
    type: ComponentType
    buffers: _containers.RepeatedCompositeFieldContainer[Buffer]
    def __init__(self, name: _Optional[str] = ..., pool: _Optional[_Union[PoolName, str]] = ..., type: _Optional[_Union[ComponentType, str]] = ..., buffers: _Optional[_Iterable[_Union[Buffer, _Mapping]]] = ...) -> None: ...

class PoolMetadata(_message.Message):
    __slots__ = ("model", "target", "draft", "tensors", "components")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    target: PoolGeometry
    draft: PoolGeometry
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    components: _containers.RepeatedCompositeFieldContainer[Component]
    def __init__(self, model: _Optional[str] = ..., target: _Optional[_Union[PoolGeometry, _Mapping]] = ..., draft: _Optional[_Union[PoolGeometry, _Mapping]] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., components: _Optional[_Iterable[_Union[Component, _Mapping]]] = ...) -> None: ...

class RemoteRegion(_message.Message):
    __slots__ = ("addr", "length", "rkey")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    RKEY_FIELD_NUMBER: _ClassVar[int]
    addr: int
    length: int
    rkey: int
    def __init__(self, addr: _Optional[int] = ..., length: _Optional[int] = ..., rkey: _Optional[int] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("kind", "gid", "qpns", "psn", "mtu", "address", "regions", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    KIND_FIELD_NUMBER: _ClassVar[int]
    GID_FIELD_NUMBER: _ClassVar[int]
    QPNS_FIELD_NUMBER: _ClassVar[int]
    PSN_FIELD_NUMBER: _ClassVar[int]
    MTU_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    kind: TransportKind
    gid: str
    qpns: _containers.RepeatedScalarFieldContainer[int]
    psn: int
    mtu: int
    address: str
    regions: _containers.RepeatedCompositeFieldContainer[RemoteRegion]
    extra: _containers.ScalarMap[str, str]
    def __init__(self, kind: _Optional[_Union[TransportKind, str]] = ..., gid: _Optional[str] = ..., qpns: _Optional[_Iterable[int]] = ..., psn: _Optional[int] = ..., mtu: _Optional[int] = ..., address: _Optional[str] = ..., regions: _Optional[_Iterable[_Union[RemoteRegion, _Mapping]]] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SideInfo(_message.Message):
    __slots__ = ("protocol_version", "role", "instance_id", "control_address", "metadata", "endpoint")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    role: Role
    instance_id: str
    control_address: str
    metadata: PoolMetadata
    endpoint: Endpoint
    def __init__(self, protocol_version: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., instance_id: _Optional[str] = ..., control_address: _Optional[str] = ..., metadata: _Optional[_Union[PoolMetadata, _Mapping]] = ..., endpoint: _Optional[_Union[Endpoint, _Mapping]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("side",)
    SIDE_FIELD_NUMBER: _ClassVar[int]
    side: SideInfo
    def __init__(self, side: _Optional[_Union[SideInfo, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("side",)
    SIDE_FIELD_NUMBER: _ClassVar[int]
    side: SideInfo
    def __init__(self, side: _Optional[_Union[SideInfo, _Mapping]] = ...) -> None: ...

class PartyValue(_message.Message):
    __slots__ = ("party", "value")
    PARTY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    party: str
    value: str
    def __init__(self, party: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class Difference(_message.Message):
    __slots__ = ("field", "side", "values", "message")
    FIELD_FIELD_NUMBER: _ClassVar[int]
    SIDE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    field: str
    side: str
    values: _containers.RepeatedCompositeFieldContainer[PartyValue]
    message: str
    def __init__(self, field: _Optional[str] = ..., side: _Optional[str] = ..., values: _Optional[_Iterable[_Union[PartyValue, _Mapping]]] = ..., message: _Optional[str] = ...) -> None: ...

class HandshakeRejection(_message.Message):
    __slots__ = ("reason", "message", "differences", "field", "protocol_version", "role", "instance_id", "metadata")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DIFFERENCES_FIELD_NUMBER: _ClassVar[int]
    FIELD_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    reason: RejectReason
    message: str
    differences: _containers.RepeatedCompositeFieldContainer[Difference]
    field: str
    protocol_version: int
    role: Role
    instance_id: str
    metadata: PoolMetadata
    def __init__(self, reason: _Optional[_Union[RejectReason, str]] = ..., message: _Optional[str] = ..., differences: _Optional[_Iterable[_Union[Difference, _Mapping]]] = ..., field: _Optional[str] = ..., protocol_version: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., instance_id: _Optional[str] = ..., metadata: _Optional[_Union[PoolMetadata, _Mapping]] = ...) -> None: ...

class TokenRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class IndexList(_message.Message):
    __slots__ = ("kind", "indices", "pool", "packed")
    KIND_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    kind: IndexKind
    indices: _containers.RepeatedScalarFieldContainer[int]
    pool: str
    packed: bytes
    def __init__(self, kind: _Optional[_Union[IndexKind, str]] = ..., indices: _Optional[_Iterable[int]] = ..., pool: _Optional[str] = ..., packed: _Optional[bytes] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "seq_len", "prefill_address", "indices", "kv_skip")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    KV_SKIP_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    seq_len: int
    prefill_address: str
    indices: _containers.RepeatedCompositeFieldContainer[IndexList]
    kv_skip: int
    def __init__(self, request_id: _Optional[str] = ..., seq_len: _Optional[int] = ..., prefill_address: _Optional[str] = ..., indices: _Optional[_Iterable[_Union[IndexList, _Mapping]]] = ..., kv_skip: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("request_id", "slot", "indices", "lease_ms", "instance_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    slot: int
    indices: _containers.RepeatedCompositeFieldContainer[IndexList]
    lease_ms: int
    instance_id: str
    def __init__(self, request_id: _Optional[str] = ..., slot: _Optional[int] = ..., indices: _Optional[_Iterable[_Union[IndexList, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class BeginWriteRequest(_message.Message):
    __slots__ = ("request_id", "instance_id", "seq_len", "digests_follow")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instance_id: str
    seq_len: int
    digests_follow: bool
    def __init__(self, request_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., seq_len: _Optional[int] = ..., digests_follow: _Optional[bool] = ...) -> None: ...

class BeginWriteResponse(_message.Message):
    __slots__ = ("request_id", "transfer_id", "slot", "indices", "instance_id", "kv_skip", "mailbox_slot")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_SKIP_FIELD_NUMBER: _ClassVar[int]
    MAILBOX_SLOT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    transfer_id: int
    slot: int
    indices: _containers.RepeatedCompositeFieldContainer[IndexList]
    instance_id: str
    kv_skip: int
    mailbox_slot: int
    def __init__(self, request_id: _Optional[str] = ..., transfer_id: _Optional[int] = ..., slot: _Optional[int] = ..., indices: _Optional[_Iterable[_Union[IndexList, _Mapping]]] = ..., instance_id: _Optional[str] = ..., kv_skip: _Optional[int] = ..., mailbox_slot: _Optional[int] = ...) -> None: ...

class OfferRequest(_message.Message):
    __slots__ = ("request_id", "instance_id", "seq_len", "transfer_id", "indices", "lease_ms", "kv_skip", "mailbox_slot")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    KV_SKIP_FIELD_NUMBER: _ClassVar[int]
    MAILBOX_SLOT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    instance_id: str
    seq_len: int
    transfer_id: int
    indices: _containers.RepeatedCompositeFieldContainer[IndexList]
    lease_ms: int
    kv_skip: int
    mailbox_slot: int
    def __init__(self, request_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., seq_len: _Optional[int] = ..., transfer_id: _Optional[int] = ..., indices: _Optional[_Iterable[_Union[IndexList, _Mapping]]] = ..., lease_ms: _Optional[int] = ..., kv_skip: _Optional[int] = ..., mailbox_slot: _Optional[int] = ...) -> None: ...

class OfferResponse(_message.Message):
    __slots__ = ("accepted", "digests_follow", "request_id", "transfer_id", "code", "detail")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    digests_follow: bool
    request_id: str
    transfer_id: int
    code: int
    detail: str
    def __init__(self, accepted: _Optional[bool] = ..., digests_follow: _Optional[bool] = ..., request_id: _Optional[str] = ..., transfer_id: _Optional[int] = ..., code: _Optional[int] = ..., detail: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class SendRequest(_message.Message):
    __slots__ = ("request_id", "source_slot", "seq_len", "decode_address", "final_chunk", "chunks", "indices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SLOT_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    FINAL_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source_slot: int
    seq_len: int
    decode_address: str
    final_chunk: bool
    chunks: _containers.RepeatedCompositeFieldContainer[TokenRange]
    indices: _containers.RepeatedCompositeFieldContainer[IndexList]
    def __init__(self, request_id: _Optional[str] = ..., source_slot: _Optional[int] = ..., seq_len: _Optional[int] = ..., decode_address: _Optional[str] = ..., final_chunk: _Optional[bool] = ..., chunks: _Optional[_Iterable[_Union[TokenRange, _Mapping]]] = ..., indices: _Optional[_Iterable[_Union[IndexList, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class TransferStatus(_message.Message):
    __slots__ = ("request_id", "state", "failure_reason", "detail", "bytes_done", "bytes_total", "slot", "peer", "age_s", "lists", "kv_skip", "verification", "timeline")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    LISTS_FIELD_NUMBER: _ClassVar[int]
    KV_SKIP_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    TIMELINE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    state: TransferState
    failure_reason: FailureReason
    detail: str
    bytes_done: int
    bytes_total: int
    slot: int
    peer: str
    age_s: float
    lists: _containers.RepeatedCompositeFieldContainer[ListLength]
    kv_skip: int
    verification: str
    timeline: _containers.RepeatedCompositeFieldContainer[StateEntered]
    def __init__(self, request_id: _Optional[str] = ..., state: _Optional[_Union[TransferState, str]] = ..., failure_reason: _Optional[_Union[FailureReason, str]] = ..., detail: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., slot: _Optional[int] = ..., peer: _Optional[str] = ..., age_s: _Optional[float] = ..., lists: _Optional[_Iterable[_Union[ListLength, _Mapping]]] = ..., kv_skip: _Optional[int] = ..., verification: _Optional[str] = ..., timeline: _Optional[_Iterable[_Union[StateEntered, _Mapping]]] = ...) -> None: ...

class ListLength(_message.Message):
    __slots__ = ("kind", "pool", "length")
    KIND_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    kind: IndexKind
    pool: str
    length: int
    def __init__(self, kind: _Optional[_Union[IndexKind, str]] = ..., pool: _Optional[str] = ..., length: _Optional[int] = ...) -> None: ...

class StateEntered(_message.Message):
    __slots__ = ("state", "after_s")
    STATE_FIELD_NUMBER: _ClassVar[int]
    AFTER_S_FIELD_NUMBER: _ClassVar[int]
    state: TransferState
    after_s: float
    def __init__(self, state: _Optional[_Union[TransferState, str]] = ..., after_s: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "detail")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    detail: str
    def __init__(self, request_id: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("instance_id",)
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    def __init__(self, instance_id: _Optional[str] = ...) -> None: ...

class ConnectRequest(_message.Message):
    __slots__ = ("control_address", "instance_id", "request_ids")
    CONTROL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    control_address: str
    instance_id: str
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, control_address: _Optional[str] = ..., instance_id: _Optional[str] = ..., request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ConnectResponse(_message.Message):
    __slots__ = ("instance_id", "decode_instance_id")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    decode_instance_id: str
    def __init__(self, instance_id: _Optional[str] = ..., decode_instance_id: _Optional[str] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("instance_id", "role", "protocol_version", "slots", "slots_held", "live_transfers")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_HELD_FIELD_NUMBER: _ClassVar[int]
    LIVE_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    role: Role
    protocol_version: int
    slots: int
    slots_held: int
    live_transfers: int
    def __init__(self, instance_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., protocol_version: _Optional[int] = ..., slots: _Optional[int] = ..., slots_held: _Optional[int] = ..., live_transfers: _Optional[int] = ...) -> None: ...
