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
    PROTOCOL_MAJOR: _ClassVar[ProtocolVersion]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_MAJOR: ProtocolVersion

class LoadRequest(_message.Message):
    __slots__ = ("model", "name", "dtype", "quantization", "revision", "tensor_parallel_size", "draft_model", "devices")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    model: str
    name: str
    dtype: str
    quantization: str
    revision: str
    tensor_parallel_size: int
    draft_model: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model: _Optional[str] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., revision: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., draft_model: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ...) -> None: ...

class LoadProgress(_message.Message):
    __slots__ = ("phase", "bytes_done", "bytes_total", "elapsed_s", "done", "model", "already_resident")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ALREADY_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    phase: str
    bytes_done: int
    bytes_total: int
    elapsed_s: float
    done: bool
    model: ModelInfo
    already_resident: bool
    def __init__(self, phase: _Optional[str] = ..., bytes_done: _Optional[int] = ..., bytes_total: _Optional[int] = ..., elapsed_s: _Optional[float] = ..., done: _Optional[bool] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., already_resident: _Optional[bool] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "strides", "slab", "offset", "nbytes", "crc32")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    SLAB_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    strides: _containers.RepeatedScalarFieldContainer[int]
    slab: int
    offset: int
    nbytes: int
    crc32: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., strides: _Optional[_Iterable[int]] = ..., slab: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class SlabInfo(_message.Message):
    __slots__ = ("index", "nbytes", "backend", "device", "device_uuid", "ipc_handle")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    index: int
    nbytes: int
    backend: str
    device: str
    device_uuid: str
    ipc_handle: bytes
    def __init__(self, index: _Optional[int] = ..., nbytes: _Optional[int] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., device_uuid: _Optional[str] = ..., ipc_handle: _Optional[bytes] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "key", "source", "dtype", "quantization", "layout", "content_checksum", "nbytes", "num_tensors", "backend", "loaded_at", "last_used_at", "leases", "config_json", "version", "latest", "num_attaches", "tensor_parallel_size", "devices", "draft_key", "draft_config_json", "draft_source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CONTENT_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_AT_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LATEST_FIELD_NUMBER: _ClassVar[int]
    NUM_ATTACHES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KEY_FIELD_NUMBER: _ClassVar[int]
    DRAFT_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    key: str
    source: str
    dtype: str
    quantization: str
    layout: str
    content_checksum: str
    nbytes: int
    num_tensors: int
    backend: str
    loaded_at: float
    last_used_at: float
    leases: _containers.RepeatedCompositeFieldContainer[LeaseInfo]
    config_json: str
    version: int
    latest: bool
    num_attaches: int
    tensor_parallel_size: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    draft_key: str
    draft_config_json: str
    draft_source: str
    def __init__(self, name: _Optional[str] = ..., key: _Optional[str] = ..., source: _Optional[str] = ..., dtype: _Optional[str] = ..., quantization: _Optional[str] = ..., layout: _Optional[str] = ..., content_checksum: _Optional[str] = ..., nbytes: _Optional[int] = ..., num_tensors: _Optional[int] = ..., backend: _Optional[str] = ..., loaded_at: _Optional[float] = ..., last_used_at: _Optional[float] = ..., leases: _Optional[_Iterable[_Union[LeaseInfo, _Mapping]]] = ..., config_json: _Optional[str] = ..., version: _Optional[int] = ..., latest: _Optional[bool] = ..., num_attaches: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., draft_key: _Optional[str] = ..., draft_config_json: _Optional[str] = ..., draft_source: _Optional[str] = ...) -> None: ...

class LeaseInfo(_message.Message):
    __slots__ = ("lease_id", "pid", "uid", "client_name", "since", "awaiting_reattach")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    AWAITING_REATTACH_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    pid: int
    uid: int
    client_name: str
    since: float
    awaiting_reattach: bool
    def __init__(self, lease_id: _Optional[str] = ..., pid: _Optional[int] = ..., uid: _Optional[int] = ..., client_name: _Optional[str] = ..., since: _Optional[float] = ..., awaiting_reattach: _Optional[bool] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("model", "expected_key", "protocol_major", "reattach", "lease_id", "tp_rank")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_KEY_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MAJOR_FIELD_NUMBER: _ClassVar[int]
    REATTACH_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    model: str
    expected_key: str
    protocol_major: int
    reattach: bool
    lease_id: str
    tp_rank: int
    def __init__(self, model: _Optional[str] = ..., expected_key: _Optional[str] = ..., protocol_major: _Optional[int] = ..., reattach: _Optional[bool] = ..., lease_id: _Optional[str] = ..., tp_rank: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("lease_id", "model", "slabs", "tensors", "protocol_major", "tp_rank")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SLABS_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MAJOR_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    model: ModelInfo
    slabs: _containers.RepeatedCompositeFieldContainer[SlabInfo]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    protocol_major: int
    tp_rank: int
    def __init__(self, lease_id: _Optional[str] = ..., model: _Optional[_Union[ModelInfo, _Mapping]] = ..., slabs: _Optional[_Iterable[_Union[SlabInfo, _Mapping]]] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., protocol_major: _Optional[int] = ..., tp_rank: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("pid", "version", "protocol_major", "socket", "fd_socket", "backend", "resident_bytes", "max_bytes", "started_at", "models", "num_sessions", "http", "weights_survive_daemon", "num_awaiting_reattach")
    PID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_MAJOR_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    FD_SOCKET_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    HTTP_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SURVIVE_DAEMON_FIELD_NUMBER: _ClassVar[int]
    NUM_AWAITING_REATTACH_FIELD_NUMBER: _ClassVar[int]
    pid: int
    version: str
    protocol_major: int
    socket: str
    fd_socket: str
    backend: str
    resident_bytes: int
    max_bytes: int
    started_at: float
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    num_sessions: int
    http: str
    weights_survive_daemon: bool
    num_awaiting_reattach: int
    def __init__(self, pid: _Optional[int] = ..., version: _Optional[str] = ..., protocol_major: _Optional[int] = ..., socket: _Optional[str] = ..., fd_socket: _Optional[str] = ..., backend: _Optional[str] = ..., resident_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., started_at: _Optional[float] = ..., models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ..., num_sessions: _Optional[int] = ..., http: _Optional[str] = ..., weights_survive_daemon: _Optional[bool] = ..., num_awaiting_reattach: _Optional[int] = ...) -> None: ...

class UnloadRequest(_message.Message):
    __slots__ = ("name", "force")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class UnloadResponse(_message.Message):
    __slots__ = ("keys",)
    KEYS_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, keys: _Optional[_Iterable[str]] = ...) -> None: ...

class ShutdownRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShutdownResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
