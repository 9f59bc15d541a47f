"""Getting point data into geonear: readers, column mapping, validation, data sets.

``read_points(source)`` turns a file, glob, ``-`` (CSV on standard input), bundled data
set name or in-memory table into a ``pyarrow.RecordBatchReader`` of ``id``, ``lat``,
``lon`` and the other columns, validated batch by batch; ``upload_points(client, name,
source)`` streams it into a server. This package never imports the service.
"""

from __future__ import annotations

from geonear.loaders.bundled import BUNDLED, DATA_SETS, load_bundled
from geonear.loaders.columns import ColumnError, ColumnMapping, detect_columns
from geonear.loaders.point_geometry import decode_wkb_points
from geonear.loaders.points import (
    LoadResult,
    PointStream,
    open_points,
    read_points,
    read_query_frame,
    read_query_points,
    upload_points,
)
from geonear.loaders.readers import FORMATS, open_source
from geonear.loaders.source import Source
from geonear.loaders.synthetic import (
    clustered_points,
    generate_points,
    uniform_points,
    write_points,
)
from geonear.loaders.validate import EmptyInput, InvalidPoints, ValidationReport
from geonear.loaders.writers import write_table

__all__ = [
    "BUNDLED",
    "DATA_SETS",
    "FORMATS",
    "ColumnError",
    "ColumnMapping",
    "EmptyInput",
    "InvalidPoints",
    "LoadResult",
    "PointStream",
    "Source",
    "ValidationReport",
    "clustered_points",
    "decode_wkb_points",
    "detect_columns",
    "generate_points",
    "load_bundled",
    "open_points",
    "open_source",
    "read_points",
    "read_query_frame",
    "read_query_points",
    "uniform_points",
    "upload_points",
    "write_points",
    "write_table",
]
