"""Analytics over a dataset's points: density clusters (DBSCAN) and areas (boxes and
spherical polygons) with the masks of the points inside them.

Plain domain functions on NumPy arrays (or a ``PointIndex``), returning NumPy results;
the service decodes requests into their arguments and encodes their answers. Importing
this package never imports CuPy: the GPU DBSCAN (``dbscan_gpu``) is imported only for a
GPU index, and the masks take their array namespace as an argument.
"""

from geonear.service.analytics.areas import (
    EDGE_TOLERANCE_RAD,
    MAX_VERTICES,
    Area,
    Bbox,
    InvalidArea,
    SphericalPolygon,
    area_mask,
    bbox_mask,
    polygon_mask,
)
from geonear.service.analytics.dbscan import (
    MAX_NEIGHBOUR_PAIRS,
    DbscanResult,
    DbscanStopped,
    TooManyNeighbours,
    dbscan,
    min_label_components,
)

__all__ = [
    "EDGE_TOLERANCE_RAD",
    "MAX_NEIGHBOUR_PAIRS",
    "MAX_VERTICES",
    "Area",
    "Bbox",
    "DbscanResult",
    "DbscanStopped",
    "InvalidArea",
    "SphericalPolygon",
    "TooManyNeighbours",
    "area_mask",
    "bbox_mask",
    "dbscan",
    "min_label_components",
    "polygon_mask",
]
