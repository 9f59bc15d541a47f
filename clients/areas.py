"""Areas as the client takes them: ``within(bbox=..., polygon=...)`` and ``within=``.

A box is ``(min_lat, min_lon, max_lat, max_lon)`` in degrees, bounds included;
``min_lon > max_lon`` crosses the antimeridian. A polygon is GeoJSON (a Polygon or
MultiPolygon, or a Feature of one, as a dict or its text), WKB bytes, or anything with
``__geo_interface__`` (a shapely geometry). The server reads and checks the area (a bad
one is InvalidArgument with the reason); edges are great-circle arcs and the boundary is
inside.

``within=`` on the queries takes either: four numbers are a box, anything else a polygon::

    within=(40.0, -10.0, 52.0, 10.0)
    within={"type": "Polygon", "coordinates": [[[2, 48], [3, 48], [3, 49], [2, 48]]]}
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np

from geonear.v1 import geonear_pb2 as pb

_FORMS = (
    "a box (min_lat, min_lon, max_lat, max_lon), a GeoJSON Polygon or MultiPolygon "
    "(a dict or its text), WKB bytes, or a shapely geometry"
)


def set_area(
    message: Any, *, bbox: Sequence[float] | np.ndarray | None = None, polygon: Any = None
) -> None:
    """Set ``bbox`` or ``polygon`` (one of the two) on ``message``: an Area, or a
    WithinRequest, whose area fields have the same names."""
    if bbox is not None:
        min_lat, min_lon, max_lat, max_lon = (float(v) for v in bbox)
        message.bbox.CopyFrom(
            pb.BoundingBox(min_lat=min_lat, min_lon=min_lon, max_lat=max_lat, max_lon=max_lon)
        )
    elif isinstance(polygon, bytes | bytearray | memoryview):
        message.polygon_wkb = bytes(polygon)
    else:
        if hasattr(polygon, "__geo_interface__"):
            polygon = polygon.__geo_interface__
        text = polygon if isinstance(polygon, str) else json.dumps(polygon)
        message.polygon_geojson = text.encode("utf-8")


def within_message(within: Any) -> pb.Area | None:
    """``within=`` as the contract's Area; None for no area.

    Four numbers (a tuple, list or array) are a box; a dict, text, bytes or a geometry a
    polygon. Raises TypeError for a sequence that is not four numbers.
    """
    if within is None:
        return None
    area = pb.Area()
    if isinstance(within, list | tuple | np.ndarray):
        if len(within) != 4 or not all(_is_number(v) for v in within):
            raise TypeError(f"within= takes {_FORMS}; got {_shown(within)}")
        set_area(area, bbox=within)
    else:
        set_area(area, polygon=within)
    return area


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
