from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WireDType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WIRE_DTYPE_UNSPECIFIED: _ClassVar[WireDType]
    FP16: _ClassVar[WireDType]
    FP32: _ClassVar[WireDType]
WIRE_DTYPE_UNSPECIFIED: WireDType
FP16: WireDType
FP32: WireDType

class PackedIds(_message.Message):
    __slots__ = ("tables", "counts", "ids")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedScalarFieldContainer[str]
    counts: _containers.RepeatedScalarFieldContainer[int]
    ids: bytes
    def __init__(self, tables: _Optional[_Iterable[str]] = ..., counts: _Optional[_Iterable[int]] = ..., ids: _Optional[bytes] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("train", "dtype", "packed")
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    train: bool
    dtype: WireDType
    packed: PackedIds
    def __init__(self, train: _Optional[bool] = ..., dtype: _Optional[_Union[WireDType, str]] = ..., packed: _Optional[_Union[PackedIds, _Mapping]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("dtype", "packed_rows", "packed_dims")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PACKED_ROWS_FIELD_NUMBER: _ClassVar[int]
    PACKED_DIMS_FIELD_NUMBER: _ClassVar[int]
    dtype: WireDType
    packed_rows: bytes
    packed_dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[_Union[WireDType, str]] = ..., packed_rows: _Optional[bytes] = ..., packed_dims: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateRequest(_message.Message):
    __slots__ = ("client_id", "seq", "packed", "packed_grads", "packed_dtype")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    PACKED_GRADS_FIELD_NUMBER: _ClassVar[int]
    PACKED_DTYPE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    seq: int
    packed: PackedIds
    packed_grads: bytes
    packed_dtype: WireDType
    def __init__(self, client_id: _Optional[str] = ..., seq: _Optional[int] = ..., packed: _Optional[_Union[PackedIds, _Mapping]] = ..., packed_grads: _Optional[bytes] = ..., packed_dtype: _Optional[_Union[WireDType, str]] = ...) -> None: ...

class UpdateResponse(_message.Message):
    __slots__ = ("rows_applied", "duplicate")
    ROWS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    rows_applied: int
    duplicate: bool
    def __init__(self, rows_applied: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class ConfigureRequest(_message.Message):
    __slots__ = ("tables_json",)
    TABLES_JSON_FIELD_NUMBER: _ClassVar[int]
    tables_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tables_json: _Optional[_Iterable[str]] = ...) -> None: ...

class ConfigureResponse(_message.Message):
    __slots__ = ("tables_json",)
    TABLES_JSON_FIELD_NUMBER: _ClassVar[int]
    tables_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tables_json: _Optional[_Iterable[str]] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("tables_json",)
    TABLES_JSON_FIELD_NUMBER: _ClassVar[int]
    tables_json: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tables_json: _Optional[_Iterable[str]] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("directory", "save_id")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    directory: str
    save_id: str
    def __init__(self, directory: _Optional[str] = ..., save_id: _Optional[str] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ("directory",)
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    directory: str
    def __init__(self, directory: _Optional[str] = ...) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveDeltaRequest(_message.Message):
    __slots__ = ("directory", "save_id", "base_id")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    SAVE_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_ID_FIELD_NUMBER: _ClassVar[int]
    directory: str
    save_id: str
    base_id: str
    def __init__(self, directory: _Optional[str] = ..., save_id: _Optional[str] = ..., base_id: _Optional[str] = ...) -> None: ...

class SaveDeltaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StageDeltaRequest(_message.Message):
    __slots__ = ("directory", "version", "base_version")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    directory: str
    version: int
    base_version: int
    def __init__(self, directory: _Optional[str] = ..., version: _Optional[int] = ..., base_version: _Optional[int] = ...) -> None: ...

class StageDeltaResponse(_message.Message):
    __slots__ = ("rows",)
    ROWS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    def __init__(self, rows: _Optional[int] = ...) -> None: ...

class CommitDeltaRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class CommitDeltaResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("shard_index", "num_shards", "json", "incarnation")
    SHARD_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    JSON_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    shard_index: int
    num_shards: int
    json: str
    incarnation: str
    def __init__(self, shard_index: _Optional[int] = ..., num_shards: _Optional[int] = ..., json: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...
