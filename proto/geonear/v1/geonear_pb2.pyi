import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UploadMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UPLOAD_MODE_UNSPECIFIED: _ClassVar[UploadMode]
    CREATE: _ClassVar[UploadMode]
    REPLACE: _ClassVar[UploadMode]
    APPEND: _ClassVar[UploadMode]

class ResultLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESULT_LAYOUT_UNSPECIFIED: _ClassVar[ResultLayout]
    ROWS: _ClassVar[ResultLayout]
    PER_QUERY: _ClassVar[ResultLayout]

class FilterOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILTER_OP_UNSPECIFIED: _ClassVar[FilterOp]
    FILTER_OP_EQ: _ClassVar[FilterOp]
    FILTER_OP_NE: _ClassVar[FilterOp]
    FILTER_OP_LT: _ClassVar[FilterOp]
    FILTER_OP_LE: _ClassVar[FilterOp]
    FILTER_OP_GT: _ClassVar[FilterOp]
    FILTER_OP_GE: _ClassVar[FilterOp]
    FILTER_OP_IN: _ClassVar[FilterOp]
    FILTER_OP_NOT_IN: _ClassVar[FilterOp]

class MatrixDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MATRIX_DTYPE_UNSPECIFIED: _ClassVar[MatrixDtype]
    FLOAT64: _ClassVar[MatrixDtype]
    FLOAT32: _ClassVar[MatrixDtype]
UPLOAD_MODE_UNSPECIFIED: UploadMode
CREATE: UploadMode
REPLACE: UploadMode
APPEND: UploadMode
RESULT_LAYOUT_UNSPECIFIED: ResultLayout
ROWS: ResultLayout
PER_QUERY: ResultLayout
FILTER_OP_UNSPECIFIED: FilterOp
FILTER_OP_EQ: FilterOp
FILTER_OP_NE: FilterOp
FILTER_OP_LT: FilterOp
FILTER_OP_LE: FilterOp
FILTER_OP_GT: FilterOp
FILTER_OP_GE: FilterOp
FILTER_OP_IN: FilterOp
FILTER_OP_NOT_IN: FilterOp
MATRIX_DTYPE_UNSPECIFIED: MatrixDtype
FLOAT64: MatrixDtype
FLOAT32: MatrixDtype

class ArrowData(_message.Message):
    __slots__ = ("schema", "record_batch", "row_count")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    RECORD_BATCH_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    schema: bytes
    record_batch: bytes
    row_count: int
    def __init__(self, schema: _Optional[bytes] = ..., record_batch: _Optional[bytes] = ..., row_count: _Optional[int] = ...) -> None: ...

class Points(_message.Message):
    __slots__ = ("lat", "lon", "arrow_ipc")
    LAT_FIELD_NUMBER: _ClassVar[int]
    LON_FIELD_NUMBER: _ClassVar[int]
    ARROW_IPC_FIELD_NUMBER: _ClassVar[int]
    lat: _containers.RepeatedScalarFieldContainer[float]
    lon: _containers.RepeatedScalarFieldContainer[float]
    arrow_ipc: bytes
    def __init__(self, lat: _Optional[_Iterable[float]] = ..., lon: _Optional[_Iterable[float]] = ..., arrow_ipc: _Optional[bytes] = ...) -> None: ...

class UploadHeader(_message.Message):
    __slots__ = ("dataset", "mode", "lat_column", "lon_column", "id_column")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    LAT_COLUMN_FIELD_NUMBER: _ClassVar[int]
    LON_COLUMN_FIELD_NUMBER: _ClassVar[int]
    ID_COLUMN_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    mode: UploadMode
    lat_column: str
    lon_column: str
    id_column: str
    def __init__(self, dataset: _Optional[str] = ..., mode: _Optional[_Union[UploadMode, str]] = ..., lat_column: _Optional[str] = ..., lon_column: _Optional[str] = ..., id_column: _Optional[str] = ...) -> None: ...

class UploadRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UploadHeader
    data: ArrowData
    def __init__(self, header: _Optional[_Union[UploadHeader, _Mapping]] = ..., data: _Optional[_Union[ArrowData, _Mapping]] = ...) -> None: ...

class UploadResponse(_message.Message):
    __slots__ = ("dataset", "rows_received")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    ROWS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    dataset: DatasetInfo
    rows_received: int
    def __init__(self, dataset: _Optional[_Union[DatasetInfo, _Mapping]] = ..., rows_received: _Optional[int] = ...) -> None: ...

class DeleteRowsRequest(_message.Message):
    __slots__ = ("dataset", "int_ids", "string_ids")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    INT_IDS_FIELD_NUMBER: _ClassVar[int]
    STRING_IDS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    int_ids: _containers.RepeatedScalarFieldContainer[int]
    string_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, dataset: _Optional[str] = ..., int_ids: _Optional[_Iterable[int]] = ..., string_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteRowsResponse(_message.Message):
    __slots__ = ("dataset", "rows_deleted", "ids_not_found")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    ROWS_DELETED_FIELD_NUMBER: _ClassVar[int]
    IDS_NOT_FOUND_FIELD_NUMBER: _ClassVar[int]
    dataset: DatasetInfo
    rows_deleted: int
    ids_not_found: int
    def __init__(self, dataset: _Optional[_Union[DatasetInfo, _Mapping]] = ..., rows_deleted: _Optional[int] = ..., ids_not_found: _Optional[int] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ...) -> None: ...

class GetDatasetRequest(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    def __init__(self, dataset: _Optional[str] = ...) -> None: ...

class DropDatasetRequest(_message.Message):
    __slots__ = ("dataset",)
    DATASET_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    def __init__(self, dataset: _Optional[str] = ...) -> None: ...

class DropDatasetResponse(_message.Message):
    __slots__ = ("dataset", "version")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    version: int
    def __init__(self, dataset: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class Column(_message.Message):
    __slots__ = ("name", "arrow_type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARROW_TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    arrow_type: str
    def __init__(self, name: _Optional[str] = ..., arrow_type: _Optional[str] = ...) -> None: ...

class BoundingBox(_message.Message):
    __slots__ = ("min_lat", "min_lon", "max_lat", "max_lon")
    MIN_LAT_FIELD_NUMBER: _ClassVar[int]
    MIN_LON_FIELD_NUMBER: _ClassVar[int]
    MAX_LAT_FIELD_NUMBER: _ClassVar[int]
    MAX_LON_FIELD_NUMBER: _ClassVar[int]
    min_lat: float
    min_lon: float
    max_lat: float
    max_lon: float
    def __init__(self, min_lat: _Optional[float] = ..., min_lon: _Optional[float] = ..., max_lat: _Optional[float] = ..., max_lon: _Optional[float] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("name", "version", "rows", "host_bytes", "device_bytes", "columns", "bounding_box", "engine", "id_type", "created_unix_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    BOUNDING_BOX_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ID_TYPE_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: int
    rows: int
    host_bytes: int
    device_bytes: int
    columns: _containers.RepeatedCompositeFieldContainer[Column]
    bounding_box: BoundingBox
    engine: str
    id_type: str
    created_unix_s: float
    def __init__(self, name: _Optional[str] = ..., version: _Optional[int] = ..., rows: _Optional[int] = ..., host_bytes: _Optional[int] = ..., device_bytes: _Optional[int] = ..., columns: _Optional[_Iterable[_Union[Column, _Mapping]]] = ..., bounding_box: _Optional[_Union[BoundingBox, _Mapping]] = ..., engine: _Optional[str] = ..., id_type: _Optional[str] = ..., created_unix_s: _Optional[float] = ...) -> None: ...

class Filter(_message.Message):
    __slots__ = ("any_of",)
    ANY_OF_FIELD_NUMBER: _ClassVar[int]
    any_of: _containers.RepeatedCompositeFieldContainer[Conjunction]
    def __init__(self, any_of: _Optional[_Iterable[_Union[Conjunction, _Mapping]]] = ...) -> None: ...

class Conjunction(_message.Message):
    __slots__ = ("all_of",)
    ALL_OF_FIELD_NUMBER: _ClassVar[int]
    all_of: _containers.RepeatedCompositeFieldContainer[Predicate]
    def __init__(self, all_of: _Optional[_Iterable[_Union[Predicate, _Mapping]]] = ...) -> None: ...

class Value(_message.Message):
    __slots__ = ("int_value", "float_value", "string_value", "bool_value", "timestamp_value")
    INT_VALUE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUE_FIELD_NUMBER: _ClassVar[int]
    STRING_VALUE_FIELD_NUMBER: _ClassVar[int]
    BOOL_VALUE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_VALUE_FIELD_NUMBER: _ClassVar[int]
    int_value: int
    float_value: float
    string_value: str
    bool_value: bool
    timestamp_value: _timestamp_pb2.Timestamp
    def __init__(self, int_value: _Optional[int] = ..., float_value: _Optional[float] = ..., string_value: _Optional[str] = ..., bool_value: _Optional[bool] = ..., timestamp_value: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class ValueList(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[Value]
    def __init__(self, values: _Optional[_Iterable[_Union[Value, _Mapping]]] = ...) -> None: ...

class Predicate(_message.Message):
    __slots__ = ("column", "op", "value", "values")
    COLUMN_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    column: str
    op: FilterOp
    value: Value
    values: ValueList
    def __init__(self, column: _Optional[str] = ..., op: _Optional[_Union[FilterOp, str]] = ..., value: _Optional[_Union[Value, _Mapping]] = ..., values: _Optional[_Union[ValueList, _Mapping]] = ...) -> None: ...

class Area(_message.Message):
    __slots__ = ("bbox", "polygon_geojson", "polygon_wkb")
    BBOX_FIELD_NUMBER: _ClassVar[int]
    POLYGON_GEOJSON_FIELD_NUMBER: _ClassVar[int]
    POLYGON_WKB_FIELD_NUMBER: _ClassVar[int]
    bbox: BoundingBox
    polygon_geojson: bytes
    polygon_wkb: bytes
    def __init__(self, bbox: _Optional[_Union[BoundingBox, _Mapping]] = ..., polygon_geojson: _Optional[bytes] = ..., polygon_wkb: _Optional[bytes] = ...) -> None: ...

class KnnRequest(_message.Message):
    __slots__ = ("dataset", "queries", "k", "max_distance_m", "columns", "layout", "where", "within")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    MAX_DISTANCE_M_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    WITHIN_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    queries: Points
    k: int
    max_distance_m: float
    columns: _containers.RepeatedScalarFieldContainer[str]
    layout: ResultLayout
    where: Filter
    within: Area
    def __init__(self, dataset: _Optional[str] = ..., queries: _Optional[_Union[Points, _Mapping]] = ..., k: _Optional[int] = ..., max_distance_m: _Optional[float] = ..., columns: _Optional[_Iterable[str]] = ..., layout: _Optional[_Union[ResultLayout, str]] = ..., where: _Optional[_Union[Filter, _Mapping]] = ..., within: _Optional[_Union[Area, _Mapping]] = ...) -> None: ...

class RadiusRequest(_message.Message):
    __slots__ = ("dataset", "queries", "radius_m", "columns", "layout", "where", "within")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    RADIUS_M_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    WITHIN_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    queries: Points
    radius_m: float
    columns: _containers.RepeatedScalarFieldContainer[str]
    layout: ResultLayout
    where: Filter
    within: Area
    def __init__(self, dataset: _Optional[str] = ..., queries: _Optional[_Union[Points, _Mapping]] = ..., radius_m: _Optional[float] = ..., columns: _Optional[_Iterable[str]] = ..., layout: _Optional[_Union[ResultLayout, str]] = ..., where: _Optional[_Union[Filter, _Mapping]] = ..., within: _Optional[_Union[Area, _Mapping]] = ...) -> None: ...

class CompactNeighbours(_message.Message):
    __slots__ = ("query_index", "rank", "int_ids", "string_ids", "distance_m", "earth_radius_m", "dataset_version")
    QUERY_INDEX_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    INT_IDS_FIELD_NUMBER: _ClassVar[int]
    STRING_IDS_FIELD_NUMBER: _ClassVar[int]
    DISTANCE_M_FIELD_NUMBER: _ClassVar[int]
    EARTH_RADIUS_M_FIELD_NUMBER: _ClassVar[int]
    DATASET_VERSION_FIELD_NUMBER: _ClassVar[int]
    query_index: _containers.RepeatedScalarFieldContainer[int]
    rank: _containers.RepeatedScalarFieldContainer[int]
    int_ids: _containers.RepeatedScalarFieldContainer[int]
    string_ids: _containers.RepeatedScalarFieldContainer[str]
    distance_m: _containers.RepeatedScalarFieldContainer[float]
    earth_radius_m: float
    dataset_version: int
    def __init__(self, query_index: _Optional[_Iterable[int]] = ..., rank: _Optional[_Iterable[int]] = ..., int_ids: _Optional[_Iterable[int]] = ..., string_ids: _Optional[_Iterable[str]] = ..., distance_m: _Optional[_Iterable[float]] = ..., earth_radius_m: _Optional[float] = ..., dataset_version: _Optional[int] = ...) -> None: ...

class IdList(_message.Message):
    __slots__ = ("int_ids", "string_ids")
    INT_IDS_FIELD_NUMBER: _ClassVar[int]
    STRING_IDS_FIELD_NUMBER: _ClassVar[int]
    int_ids: _containers.RepeatedScalarFieldContainer[int]
    string_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, int_ids: _Optional[_Iterable[int]] = ..., string_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class DistanceMatrixRequest(_message.Message):
    __slots__ = ("queries", "dataset", "ids", "targets", "dtype", "where", "within")
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    WITHIN_FIELD_NUMBER: _ClassVar[int]
    queries: Points
    dataset: str
    ids: IdList
    targets: Points
    dtype: MatrixDtype
    where: Filter
    within: Area
    def __init__(self, queries: _Optional[_Union[Points, _Mapping]] = ..., dataset: _Optional[str] = ..., ids: _Optional[_Union[IdList, _Mapping]] = ..., targets: _Optional[_Union[Points, _Mapping]] = ..., dtype: _Optional[_Union[MatrixDtype, str]] = ..., where: _Optional[_Union[Filter, _Mapping]] = ..., within: _Optional[_Union[Area, _Mapping]] = ...) -> None: ...

class MatrixTile(_message.Message):
    __slots__ = ("row_start", "col_start", "row_count", "col_count", "values", "total_rows", "total_cols", "earth_radius_m", "dtype")
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    COL_START_FIELD_NUMBER: _ClassVar[int]
    ROW_COUNT_FIELD_NUMBER: _ClassVar[int]
    COL_COUNT_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_COLS_FIELD_NUMBER: _ClassVar[int]
    EARTH_RADIUS_M_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    row_start: int
    col_start: int
    row_count: int
    col_count: int
    values: bytes
    total_rows: int
    total_cols: int
    earth_radius_m: float
    dtype: MatrixDtype
    def __init__(self, row_start: _Optional[int] = ..., col_start: _Optional[int] = ..., row_count: _Optional[int] = ..., col_count: _Optional[int] = ..., values: _Optional[bytes] = ..., total_rows: _Optional[int] = ..., total_cols: _Optional[int] = ..., earth_radius_m: _Optional[float] = ..., dtype: _Optional[_Union[MatrixDtype, str]] = ...) -> None: ...

class KMeansRequest(_message.Message):
    __slots__ = ("dataset", "k", "seed", "n_init", "max_iter", "tol", "weight_column", "return_labels", "where", "within")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_INIT_FIELD_NUMBER: _ClassVar[int]
    MAX_ITER_FIELD_NUMBER: _ClassVar[int]
    TOL_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_COLUMN_FIELD_NUMBER: _ClassVar[int]
    RETURN_LABELS_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    WITHIN_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    k: int
    seed: int
    n_init: int
    max_iter: int
    tol: float
    weight_column: str
    return_labels: bool
    where: Filter
    within: Area
    def __init__(self, dataset: _Optional[str] = ..., k: _Optional[int] = ..., seed: _Optional[int] = ..., n_init: _Optional[int] = ..., max_iter: _Optional[int] = ..., tol: _Optional[float] = ..., weight_column: _Optional[str] = ..., return_labels: _Optional[bool] = ..., where: _Optional[_Union[Filter, _Mapping]] = ..., within: _Optional[_Union[Area, _Mapping]] = ...) -> None: ...

class KMeansSummary(_message.Message):
    __slots__ = ("centroids", "inertia_m2", "n_iter", "earth_radius_m", "dataset_version")
    CENTROIDS_FIELD_NUMBER: _ClassVar[int]
    INERTIA_M2_FIELD_NUMBER: _ClassVar[int]
    N_ITER_FIELD_NUMBER: _ClassVar[int]
    EARTH_RADIUS_M_FIELD_NUMBER: _ClassVar[int]
    DATASET_VERSION_FIELD_NUMBER: _ClassVar[int]
    centroids: ArrowData
    inertia_m2: float
    n_iter: int
    earth_radius_m: float
    dataset_version: int
    def __init__(self, centroids: _Optional[_Union[ArrowData, _Mapping]] = ..., inertia_m2: _Optional[float] = ..., n_iter: _Optional[int] = ..., earth_radius_m: _Optional[float] = ..., dataset_version: _Optional[int] = ...) -> None: ...

class KMeansResponse(_message.Message):
    __slots__ = ("summary", "labels")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    summary: KMeansSummary
    labels: ArrowData
    def __init__(self, summary: _Optional[_Union[KMeansSummary, _Mapping]] = ..., labels: _Optional[_Union[ArrowData, _Mapping]] = ...) -> None: ...

class CountWithinRequest(_message.Message):
    __slots__ = ("dataset", "queries", "left_dataset", "radius_m", "where", "within", "narrow_integers")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    LEFT_DATASET_FIELD_NUMBER: _ClassVar[int]
    RADIUS_M_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    WITHIN_FIELD_NUMBER: _ClassVar[int]
    NARROW_INTEGERS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    queries: Points
    left_dataset: str
    radius_m: float
    where: Filter
    within: Area
    narrow_integers: bool
    def __init__(self, dataset: _Optional[str] = ..., queries: _Optional[_Union[Points, _Mapping]] = ..., left_dataset: _Optional[str] = ..., radius_m: _Optional[float] = ..., where: _Optional[_Union[Filter, _Mapping]] = ..., within: _Optional[_Union[Area, _Mapping]] = ..., narrow_integers: _Optional[bool] = ...) -> None: ...

class KnnJoinRequest(_message.Message):
    __slots__ = ("left_dataset", "right_dataset", "k", "max_distance_m", "where", "left_columns", "right_columns", "layout", "within", "narrow_integers")
    LEFT_DATASET_FIELD_NUMBER: _ClassVar[int]
    RIGHT_DATASET_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    MAX_DISTANCE_M_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    LEFT_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    RIGHT_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WITHIN_FIELD_NUMBER: _ClassVar[int]
    NARROW_INTEGERS_FIELD_NUMBER: _ClassVar[int]
    left_dataset: str
    right_dataset: str
    k: int
    max_distance_m: float
    where: Filter
    left_columns: _containers.RepeatedScalarFieldContainer[str]
    right_columns: _containers.RepeatedScalarFieldContainer[str]
    layout: ResultLayout
    within: Area
    narrow_integers: bool
    def __init__(self, left_dataset: _Optional[str] = ..., right_dataset: _Optional[str] = ..., k: _Optional[int] = ..., max_distance_m: _Optional[float] = ..., where: _Optional[_Union[Filter, _Mapping]] = ..., left_columns: _Optional[_Iterable[str]] = ..., right_columns: _Optional[_Iterable[str]] = ..., layout: _Optional[_Union[ResultLayout, str]] = ..., within: _Optional[_Union[Area, _Mapping]] = ..., narrow_integers: _Optional[bool] = ...) -> None: ...

class RadiusJoinRequest(_message.Message):
    __slots__ = ("left_dataset", "right_dataset", "radius_m", "where", "left_columns", "right_columns", "layout", "within", "narrow_integers")
    LEFT_DATASET_FIELD_NUMBER: _ClassVar[int]
    RIGHT_DATASET_FIELD_NUMBER: _ClassVar[int]
    RADIUS_M_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    LEFT_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    RIGHT_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    WITHIN_FIELD_NUMBER: _ClassVar[int]
    NARROW_INTEGERS_FIELD_NUMBER: _ClassVar[int]
    left_dataset: str
    right_dataset: str
    radius_m: float
    where: Filter
    left_columns: _containers.RepeatedScalarFieldContainer[str]
    right_columns: _containers.RepeatedScalarFieldContainer[str]
    layout: ResultLayout
    within: Area
    narrow_integers: bool
    def __init__(self, left_dataset: _Optional[str] = ..., right_dataset: _Optional[str] = ..., radius_m: _Optional[float] = ..., where: _Optional[_Union[Filter, _Mapping]] = ..., left_columns: _Optional[_Iterable[str]] = ..., right_columns: _Optional[_Iterable[str]] = ..., layout: _Optional[_Union[ResultLayout, str]] = ..., within: _Optional[_Union[Area, _Mapping]] = ..., narrow_integers: _Optional[bool] = ...) -> None: ...

class DbscanRequest(_message.Message):
    __slots__ = ("dataset", "eps_m", "min_samples", "where", "return_labels", "within")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    EPS_M_FIELD_NUMBER: _ClassVar[int]
    MIN_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    RETURN_LABELS_FIELD_NUMBER: _ClassVar[int]
    WITHIN_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    eps_m: float
    min_samples: int
    where: Filter
    return_labels: bool
    within: Area
    def __init__(self, dataset: _Optional[str] = ..., eps_m: _Optional[float] = ..., min_samples: _Optional[int] = ..., where: _Optional[_Union[Filter, _Mapping]] = ..., return_labels: _Optional[bool] = ..., within: _Optional[_Union[Area, _Mapping]] = ...) -> None: ...

class DbscanSummary(_message.Message):
    __slots__ = ("n_clusters", "sizes", "n_noise", "earth_radius_m", "dataset_version")
    N_CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    SIZES_FIELD_NUMBER: _ClassVar[int]
    N_NOISE_FIELD_NUMBER: _ClassVar[int]
    EARTH_RADIUS_M_FIELD_NUMBER: _ClassVar[int]
    DATASET_VERSION_FIELD_NUMBER: _ClassVar[int]
    n_clusters: int
    sizes: _containers.RepeatedScalarFieldContainer[int]
    n_noise: int
    earth_radius_m: float
    dataset_version: int
    def __init__(self, n_clusters: _Optional[int] = ..., sizes: _Optional[_Iterable[int]] = ..., n_noise: _Optional[int] = ..., earth_radius_m: _Optional[float] = ..., dataset_version: _Optional[int] = ...) -> None: ...

class DbscanResponse(_message.Message):
    __slots__ = ("summary", "labels")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    summary: DbscanSummary
    labels: ArrowData
    def __init__(self, summary: _Optional[_Union[DbscanSummary, _Mapping]] = ..., labels: _Optional[_Union[ArrowData, _Mapping]] = ...) -> None: ...

class WithinRequest(_message.Message):
    __slots__ = ("dataset", "bbox", "polygon_geojson", "polygon_wkb", "columns", "where")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    BBOX_FIELD_NUMBER: _ClassVar[int]
    POLYGON_GEOJSON_FIELD_NUMBER: _ClassVar[int]
    POLYGON_WKB_FIELD_NUMBER: _ClassVar[int]
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    bbox: BoundingBox
    polygon_geojson: bytes
    polygon_wkb: bytes
    columns: _containers.RepeatedScalarFieldContainer[str]
    where: Filter
    def __init__(self, dataset: _Optional[str] = ..., bbox: _Optional[_Union[BoundingBox, _Mapping]] = ..., polygon_geojson: _Optional[bytes] = ..., polygon_wkb: _Optional[bytes] = ..., columns: _Optional[_Iterable[str]] = ..., where: _Optional[_Union[Filter, _Mapping]] = ...) -> None: ...

class ServerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Limits(_message.Message):
    __slots__ = ("max_k", "max_matrix_cells", "max_upload_rows", "max_message_bytes", "max_query_points", "max_concurrent_rpcs", "max_dataset_host_bytes", "max_dataset_device_bytes", "max_result_rows")
    MAX_K_FIELD_NUMBER: _ClassVar[int]
    MAX_MATRIX_CELLS_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_QUERY_POINTS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONCURRENT_RPCS_FIELD_NUMBER: _ClassVar[int]
    MAX_DATASET_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_DATASET_DEVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_RESULT_ROWS_FIELD_NUMBER: _ClassVar[int]
    max_k: int
    max_matrix_cells: int
    max_upload_rows: int
    max_message_bytes: int
    max_query_points: int
    max_concurrent_rpcs: int
    max_dataset_host_bytes: int
    max_dataset_device_bytes: int
    max_result_rows: int
    def __init__(self, max_k: _Optional[int] = ..., max_matrix_cells: _Optional[int] = ..., max_upload_rows: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., max_query_points: _Optional[int] = ..., max_concurrent_rpcs: _Optional[int] = ..., max_dataset_host_bytes: _Optional[int] = ..., max_dataset_device_bytes: _Optional[int] = ..., max_result_rows: _Optional[int] = ...) -> None: ...

class ServerInfoResponse(_message.Message):
    __slots__ = ("version", "backend", "device", "earth_radius_m", "limits", "engines", "pool_used_bytes", "pool_total_bytes", "worker_processes", "worker_index", "engine_descriptions")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    EARTH_RADIUS_M_FIELD_NUMBER: _ClassVar[int]
    LIMITS_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    POOL_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOL_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    ENGINE_DESCRIPTIONS_FIELD_NUMBER: _ClassVar[int]
    version: str
    backend: str
    device: str
    earth_radius_m: float
    limits: Limits
    engines: _containers.RepeatedScalarFieldContainer[str]
    pool_used_bytes: int
    pool_total_bytes: int
    worker_processes: int
    worker_index: int
    engine_descriptions: _containers.RepeatedCompositeFieldContainer[EngineDescription]
    def __init__(self, version: _Optional[str] = ..., backend: _Optional[str] = ..., device: _Optional[str] = ..., earth_radius_m: _Optional[float] = ..., limits: _Optional[_Union[Limits, _Mapping]] = ..., engines: _Optional[_Iterable[str]] = ..., pool_used_bytes: _Optional[int] = ..., pool_total_bytes: _Optional[int] = ..., worker_processes: _Optional[int] = ..., worker_index: _Optional[int] = ..., engine_descriptions: _Optional[_Iterable[_Union[EngineDescription, _Mapping]]] = ...) -> None: ...

class EngineDescription(_message.Message):
    __slots__ = ("name", "device_kind", "capabilities", "summary")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    name: str
    device_kind: str
    capabilities: _containers.RepeatedScalarFieldContainer[str]
    summary: str
    def __init__(self, name: _Optional[str] = ..., device_kind: _Optional[str] = ..., capabilities: _Optional[_Iterable[str]] = ..., summary: _Optional[str] = ...) -> None: ...
