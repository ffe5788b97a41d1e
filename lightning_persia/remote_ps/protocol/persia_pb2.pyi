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
    __slots__ = ("train", "dtype", "packed", "map_version")
    TRAIN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    train: bool
    dtype: WireDType
    packed: PackedIds
    map_version: int
    def __init__(self, train: _Optional[bool] = ..., dtype: _Optional[_Union[WireDType, str]] = ..., packed: _Optional[_Union[PackedIds, _Mapping]] = ..., map_version: _Optional[int] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("dtype", "packed_rows", "packed_dims", "map_version")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PACKED_ROWS_FIELD_NUMBER: _ClassVar[int]
    PACKED_DIMS_FIELD_NUMBER: _ClassVar[int]
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    dtype: WireDType
    packed_rows: bytes
    packed_dims: _containers.RepeatedScalarFieldContainer[int]
    map_version: int
    def __init__(self, dtype: _Optional[_Union[WireDType, str]] = ..., packed_rows: _Optional[bytes] = ..., packed_dims: _Optional[_Iterable[int]] = ..., map_version: _Optional[int] = ...) -> None: ...

class UpdateRequest(_message.Message):
    __slots__ = ("client_id", "seq", "packed", "packed_grads", "packed_dtype", "map_version")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    PACKED_GRADS_FIELD_NUMBER: _ClassVar[int]
    PACKED_DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    seq: int
    packed: PackedIds
    packed_grads: bytes
    packed_dtype: WireDType
    map_version: int
    def __init__(self, client_id: _Optional[str] = ..., seq: _Optional[int] = ..., packed: _Optional[_Union[PackedIds, _Mapping]] = ..., packed_grads: _Optional[bytes] = ..., packed_dtype: _Optional[_Union[WireDType, str]] = ..., map_version: _Optional[int] = ...) -> None: ...

class UpdateResponse(_message.Message):
    __slots__ = ("rows_applied", "duplicate", "map_version")
    ROWS_APPLIED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    rows_applied: int
    duplicate: bool
    map_version: int
    def __init__(self, rows_applied: _Optional[int] = ..., duplicate: _Optional[bool] = ..., map_version: _Optional[int] = ...) -> None: ...

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

class ShardMapMessage(_message.Message):
    __slots__ = ("version", "owners", "addresses")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OWNERS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    version: int
    owners: bytes
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., owners: _Optional[bytes] = ..., addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class GetShardMapRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HandoverStep(_message.Message):
    __slots__ = ("step", "map")
    class Step(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STEP_UNSPECIFIED: _ClassVar[HandoverStep.Step]
        BEGIN: _ClassVar[HandoverStep.Step]
        ROWS: _ClassVar[HandoverStep.Step]
        CHANGES: _ClassVar[HandoverStep.Step]
        FENCE: _ClassVar[HandoverStep.Step]
        FINISH: _ClassVar[HandoverStep.Step]
        ABORT: _ClassVar[HandoverStep.Step]
        SETTLE: _ClassVar[HandoverStep.Step]
        SIGHTINGS: _ClassVar[HandoverStep.Step]
    STEP_UNSPECIFIED: HandoverStep.Step
    BEGIN: HandoverStep.Step
    ROWS: HandoverStep.Step
    CHANGES: HandoverStep.Step
    FENCE: HandoverStep.Step
    FINISH: HandoverStep.Step
    ABORT: HandoverStep.Step
    SETTLE: HandoverStep.Step
    SIGHTINGS: HandoverStep.Step
    STEP_FIELD_NUMBER: _ClassVar[int]
    MAP_FIELD_NUMBER: _ClassVar[int]
    step: HandoverStep.Step
    map: ShardMapMessage
    def __init__(self, step: _Optional[_Union[HandoverStep.Step, str]] = ..., map: _Optional[_Union[ShardMapMessage, _Mapping]] = ...) -> None: ...

class SlotSightings(_message.Message):
    __slots__ = ("table", "slots", "counters")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    table: str
    slots: bytes
    counters: bytes
    def __init__(self, table: _Optional[str] = ..., slots: _Optional[bytes] = ..., counters: _Optional[bytes] = ...) -> None: ...

class HandoverPage(_message.Message):
    __slots__ = ("tables_json", "records", "done", "rows", "applied_json", "source", "map_version", "sightings", "fenced")
    TABLES_JSON_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_JSON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MAP_VERSION_FIELD_NUMBER: _ClassVar[int]
    SIGHTINGS_FIELD_NUMBER: _ClassVar[int]
    FENCED_FIELD_NUMBER: _ClassVar[int]
    tables_json: _containers.RepeatedScalarFieldContainer[str]
    records: _containers.RepeatedScalarFieldContainer[bytes]
    done: bool
    rows: int
    applied_json: str
    source: int
    map_version: int
    sightings: _containers.RepeatedCompositeFieldContainer[SlotSightings]
    fenced: bool
    def __init__(self, tables_json: _Optional[_Iterable[str]] = ..., records: _Optional[_Iterable[bytes]] = ..., done: _Optional[bool] = ..., rows: _Optional[int] = ..., applied_json: _Optional[str] = ..., source: _Optional[int] = ..., map_version: _Optional[int] = ..., sightings: _Optional[_Iterable[_Union[SlotSightings, _Mapping]]] = ..., fenced: _Optional[bool] = ...) -> None: ...

class TakeOverRequest(_message.Message):
    __slots__ = ("page", "to_map", "adopt")
    PAGE_FIELD_NUMBER: _ClassVar[int]
    TO_MAP_FIELD_NUMBER: _ClassVar[int]
    ADOPT_FIELD_NUMBER: _ClassVar[int]
    page: HandoverPage
    to_map: ShardMapMessage
    adopt: bool
    def __init__(self, page: _Optional[_Union[HandoverPage, _Mapping]] = ..., to_map: _Optional[_Union[ShardMapMessage, _Mapping]] = ..., adopt: _Optional[bool] = ...) -> None: ...

class TakeOverResponse(_message.Message):
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
