"""GeoJSON: FeatureCollections, Features and newline-delimited features of Point
geometries, streamed."""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import pyarrow as pa

from geonear.loaders.source import Source


class _JsonStream:
    """Values of a JSON text read piecewise, so a large FeatureCollection streams.

    Only the top level is walked by hand (objects' keys, the ``features`` array); every
    value is decoded by :class:`json.JSONDecoder`.
    """

    def __init__(self, text: io.TextIOBase, what: str) -> None:
        self._text = text
        self._what = what
        self._buf = ""
        self._pos = 0
        self._eof = False
        self._decoder = json.JSONDecoder()

    def _fill(self) -> bool:
        if self._eof:
            return False
        chunk = self._text.read(1 << 20)
        if not chunk:
            self._eof = True
            return False
        self._buf = self._buf[self._pos :] + chunk
        self._pos = 0
        return True

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end)."""
        while True:
            while self._pos < len(self._buf) and self._buf[self._pos] in " \t\r\n\x1e":
                self._pos += 1
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if not self._fill():
                return ""

    def expect(self, char: str) -> None:
        if self.peek() != char:
            got = self.peek() or "end of input"
            raise ValueError(f"invalid GeoJSON in {self._what}: expected {char!r}, got {got!r}")
        self._pos += 1

    def value(self) -> Any:
        self.peek()
        while True:
            try:
                value, end = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as exc:
                # Possibly cut off at the end of the buffer: read more and try again.
                if self._fill():
                    continue
                raise ValueError(f"invalid GeoJSON in {self._what}: {exc}") from exc
            # A number at the very end of the buffer may continue in the next chunk.
            if end == len(self._buf) and isinstance(value, int | float) and self._fill():
                continue
            self._pos = end
            return value


def _geojson_features(stream: _JsonStream) -> Iterator[dict[str, Any]]:
    """Features of a FeatureCollection, a Feature, or a sequence of either."""
    while stream.peek():
        if stream.peek() != "{":
            yield from _features_of(stream.value())
            continue
        stream.expect("{")
        members: dict[str, Any] = {}
        while stream.peek() != "}":
            key = stream.value()
            stream.expect(":")
            if key == "features" and stream.peek() == "[":
                stream.expect("[")
                while stream.peek() != "]":
                    yield stream.value()
                    if stream.peek() == ",":
                        stream.expect(",")
                stream.expect("]")
            else:
                members[key] = stream.value()
            if stream.peek() == ",":
                stream.expect(",")
        stream.expect("}")
        if members.get("type") == "Feature":
            yield members
        elif members.get("type") not in ("FeatureCollection", None):
            raise ValueError(
                f"GeoJSON object of type {members.get('type')!r} holds no "
                "features; give a FeatureCollection or Features"
            )


def _features_of(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, list):
        for item in value:
            yield from _features_of(item)
    elif isinstance(value, dict) and value.get("type") == "FeatureCollection":
        yield from value.get("features", [])
    elif isinstance(value, dict) and value.get("type") == "Feature":
        yield value
    else:
        raise ValueError("GeoJSON input must hold Feature objects")


def _feature_rows(
    features: Iterable[dict[str, Any]], first_row: int
) -> Iterator[tuple[float, float, dict[str, Any]]]:
    for i, feature in enumerate(features, first_row):
        geometry = feature.get("geometry")
        props = dict(feature.get("properties") or {})
        if "id" in feature and "id" not in props:
            props["id"] = feature["id"]
        if geometry is None:
            yield float("nan"), float("nan"), props
            continue
        kind = geometry.get("type")
        if kind != "Point":
            raise ValueError(
                f"feature {i} has a {kind} geometry; only Point features can be loaded"
            )
        coords = geometry.get("coordinates") or []
        if len(coords) < 2:
            yield float("nan"), float("nan"), props
            continue
        yield coords[0], coords[1], props


def read_geojson_files(files: Sequence[Path | BinaryIO], batch_rows: int, what: str) -> Source:
    """GeoJSON files (or binary streams, such as standard input) as one source."""

    def features() -> Iterator[dict[str, Any]]:
        for path in files:
            if not isinstance(path, Path):
                text = io.TextIOWrapper(path, encoding="utf-8-sig")
                try:
                    yield from _geojson_features(_JsonStream(text, what))
                finally:
                    text.detach()  # the stream is the caller's to close
                continue
            raw = pa.input_stream(str(path), compression="detect")
            with io.TextIOWrapper(raw, encoding="utf-8-sig") as text:
                yield from _geojson_features(_JsonStream(text, str(path)))

    rows = _feature_rows(features(), 0)
    first = _geojson_batch(rows, batch_rows, None)
    if first is None:
        schema = pa.schema([("lat", pa.float64()), ("lon", pa.float64())])
        return Source(
            pa.RecordBatchReader.from_batches(schema, iter(())), what, geometry=("lat", "lon")
        )
    schema = first.schema

    def batches() -> Iterator[pa.RecordBatch]:
        yield first
        while (batch := _geojson_batch(rows, batch_rows, schema)) is not None:
            yield batch

    lat_name, lon_name = schema.names[0], schema.names[1]
    return Source(
        pa.RecordBatchReader.from_batches(schema, batches()), what, geometry=(lat_name, lon_name)
    )


def _geojson_batch(
    rows: Iterator[tuple[float, float, dict[str, Any]]], batch_rows: int, schema: pa.Schema | None
) -> pa.RecordBatch | None:
    """The next batch of features; the first batch fixes the schema of the rest."""
    lons, lats, props = [], [], []
    for lon, lat, p in rows:
        lons.append(lon)
        lats.append(lat)
        props.append(p)
        if len(props) == batch_rows:
            break
    if not props:
        return None
    if schema is None:
        attrs = pa.Table.from_pylist(props)
        lat_name = "lat" if "lat" not in attrs.column_names else "geometry_lat"
        lon_name = "lon" if "lon" not in attrs.column_names else "geometry_lon"
        schema = pa.schema([(lat_name, pa.float64()), (lon_name, pa.float64()), *attrs.schema])
    else:
        try:
            attrs = pa.Table.from_pylist(props, schema=pa.schema(list(schema)[2:]))
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            raise ValueError(
                f"GeoJSON properties change type after the first {batch_rows} features: {exc}"
            ) from exc
    coords = [_coordinate_array(lats), _coordinate_array(lons)]
    return pa.RecordBatch.from_arrays(
        coords + [attrs.column(i).combine_chunks() for i in range(attrs.num_columns)], schema=schema
    )


def _coordinate_array(values: list[Any]) -> pa.Array:
    """Coordinates as float64; a value that is not a JSON number becomes null (missing)."""
    try:
        return pa.array(values, pa.float64())
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
        return pa.array(
            [v if isinstance(v, int | float) and not isinstance(v, bool) else None for v in values],
            pa.float64(),
        )
