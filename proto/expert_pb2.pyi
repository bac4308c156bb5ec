from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    F32: _ClassVar[DType]
    F16: _ClassVar[DType]
    BF16: _ClassVar[DType]
    Q8_0: _ClassVar[DType]
    Q8_K: _ClassVar[DType]
    F32_PLANES: _ClassVar[DType]

class Numerics(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NUMERICS_UNSPECIFIED: _ClassVar[Numerics]
    NATIVE: _ClassVar[Numerics]
    EXACT: _ClassVar[Numerics]
DTYPE_UNSPECIFIED: DType
F32: DType
F16: DType
BF16: DType
Q8_0: DType
Q8_K: DType
F32_PLANES: DType
NUMERICS_UNSPECIFIED: Numerics
NATIVE: Numerics
EXACT: Numerics

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ComputeRequest(_message.Message):
    __slots__ = ("fingerprint", "protocol_version", "layer", "expert_ids", "counts", "rows", "out_dtype", "numerics", "inner")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    OUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    INNER_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    protocol_version: int
    layer: int
    expert_ids: _containers.RepeatedScalarFieldContainer[int]
    counts: _containers.RepeatedScalarFieldContainer[int]
    rows: Tensor
    out_dtype: DType
    numerics: Numerics
    inner: bool
    def __init__(self, fingerprint: _Optional[str] = ..., protocol_version: _Optional[int] = ..., layer: _Optional[int] = ..., expert_ids: _Optional[_Iterable[int]] = ..., counts: _Optional[_Iterable[int]] = ..., rows: _Optional[_Union[Tensor, _Mapping]] = ..., out_dtype: _Optional[_Union[DType, str]] = ..., numerics: _Optional[_Union[Numerics, str]] = ..., inner: _Optional[bool] = ...) -> None: ...

class ComputeReply(_message.Message):
    __slots__ = ("rows", "inner")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    INNER_FIELD_NUMBER: _ClassVar[int]
    rows: Tensor
    inner: Tensor
    def __init__(self, rows: _Optional[_Union[Tensor, _Mapping]] = ..., inner: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IdRange(_message.Message):
    __slots__ = ("first", "last")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    first: int
    last: int
    def __init__(self, first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class SlabGroup(_message.Message):
    __slots__ = ("layers", "experts")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[IdRange]
    experts: _containers.RepeatedCompositeFieldContainer[IdRange]
    def __init__(self, layers: _Optional[_Iterable[_Union[IdRange, _Mapping]]] = ..., experts: _Optional[_Iterable[_Union[IdRange, _Mapping]]] = ...) -> None: ...

class InfoReply(_message.Message):
    __slots__ = ("fingerprint", "protocol_version", "held", "device", "memory_budget_bytes", "max_message_bytes", "workers", "hidden_size", "node_name", "version", "source_sha256", "serves_files", "stream_port", "numerics_class")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SHA256_FIELD_NUMBER: _ClassVar[int]
    SERVES_FILES_FIELD_NUMBER: _ClassVar[int]
    STREAM_PORT_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_CLASS_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    protocol_version: int
    held: _containers.RepeatedCompositeFieldContainer[SlabGroup]
    device: str
    memory_budget_bytes: int
    max_message_bytes: int
    workers: int
    hidden_size: int
    node_name: str
    version: str
    source_sha256: str
    serves_files: bool
    stream_port: int
    numerics_class: str
    def __init__(self, fingerprint: _Optional[str] = ..., protocol_version: _Optional[int] = ..., held: _Optional[_Iterable[_Union[SlabGroup, _Mapping]]] = ..., device: _Optional[str] = ..., memory_budget_bytes: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., workers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., node_name: _Optional[str] = ..., version: _Optional[str] = ..., source_sha256: _Optional[str] = ..., serves_files: _Optional[bool] = ..., stream_port: _Optional[int] = ..., numerics_class: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpertCount(_message.Message):
    __slots__ = ("layer", "expert", "calls", "rows")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert: int
    calls: int
    rows: int
    def __init__(self, layer: _Optional[int] = ..., expert: _Optional[int] = ..., calls: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("calls", "rows", "errors", "experts", "cache_hits", "cache_misses", "cache_evictions", "cache_bytes", "busy_seconds", "uptime_seconds", "in_flight", "dropped")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    calls: int
    rows: int
    errors: int
    experts: _containers.RepeatedCompositeFieldContainer[ExpertCount]
    cache_hits: int
    cache_misses: int
    cache_evictions: int
    cache_bytes: int
    busy_seconds: float
    uptime_seconds: float
    in_flight: int
    dropped: _containers.RepeatedCompositeFieldContainer[SlabGroup]
    def __init__(self, calls: _Optional[int] = ..., rows: _Optional[int] = ..., errors: _Optional[int] = ..., experts: _Optional[_Iterable[_Union[ExpertCount, _Mapping]]] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., cache_evictions: _Optional[int] = ..., cache_bytes: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., uptime_seconds: _Optional[float] = ..., in_flight: _Optional[int] = ..., dropped: _Optional[_Iterable[_Union[SlabGroup, _Mapping]]] = ...) -> None: ...

class FetchRequest(_message.Message):
    __slots__ = ("fingerprint", "protocol_version", "path", "offset")
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    fingerprint: str
    protocol_version: int
    path: str
    offset: int
    def __init__(self, fingerprint: _Optional[str] = ..., protocol_version: _Optional[int] = ..., path: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class FileChunk(_message.Message):
    __slots__ = ("offset", "data", "size")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    size: int
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., size: _Optional[int] = ...) -> None: ...
