"""Which columns of a source hold latitude, longitude and ids.

Rules, applied in this order for each of lat, lon and id:

1. A name given by the caller wins; it must exist (an exact match, else a unique
   case-insensitive one).
2. For lat and lon, columns decoded from a point geometry (GeoJSON, GeoParquet) win.
3. Otherwise the candidates are the columns whose lower-cased name is a known spelling
   (``LAT_NAMES``, ``LON_NAMES``, ``ID_NAMES``). A column named exactly ``lat``, ``lon``
   or ``id`` wins over the other spellings; one candidate is taken; several are an error
   naming them.
4. No lat or lon candidate is an error naming the columns found; no id candidate means
   row numbers become the ids, and the mapping says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

#: Known spellings, lower case, the canonical name first.
LAT_NAMES = ("lat", "latitude", "y")
LON_NAMES = ("lon", "lng", "long", "longitude", "x")
ID_NAMES = ("id", "name", "code")
#: Columns of a mapped stream; attribute columns that reuse one are renamed.
RESERVED = ("id", "lat", "lon")
#: Suffix of an attribute column renamed because its name is now a mapped column's.
RENAMED_SUFFIX = "_original"

_OPTION = {"lat": "--lat / lat=", "lon": "--lon / lon=", "id": "--id / id="}


class ColumnError(ValueError):
    """A lat, lon or id column that is missing, ambiguous or of the wrong type."""


@dataclass(frozen=True)
class ColumnMapping:
    """Source column names of the mapped columns.

    ``id`` is None when row numbers (0-based, in source order) are the ids.
    ``renamed`` maps attribute columns renamed to avoid a mapped column's name.
    """

    lat: str
    lon: str
    id: str | None
    renamed: dict[str, str] = field(default_factory=dict)

    @property
    def ids_are_row_numbers(self) -> bool:
        return self.id is None

    def describe(self) -> str:
        """One line for people: which column became what."""
        parts = [
            f"lat <- {self.lat!r}",
            f"lon <- {self.lon!r}",
            "id <- row numbers (no id column)" if self.id is None else f"id <- {self.id!r}",
        ]
        parts += [f"{old!r} renamed {new!r}" for old, new in self.renamed.items()]
        return ", ".join(parts)


def candidates(names: Sequence[str], spellings: Sequence[str]) -> list[str]:
    """Columns of ``names`` whose lower-cased name is one of ``spellings``, in that order."""
    lowered = [n.lower() for n in names]
    return [names[i] for s in spellings for i, low in enumerate(lowered) if low == s]


def _resolve(names: Sequence[str], wanted: str, role: str) -> str:
    if wanted in names:
        return wanted
    folded = [n for n in names if n.lower() == wanted.lower()]
    if len(folded) == 1:
        return folded[0]
    raise ColumnError(f"no {role} column {wanted!r}; columns found: {', '.join(names) or '(none)'}")


def _detect(names: Sequence[str], spellings: Sequence[str], role: str) -> str | None:
    found = candidates(names, spellings)
    if spellings[0] in found:
        return spellings[0]
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        raise ColumnError(
            f"ambiguous {role} column: candidates {', '.join(map(repr, found))}; "
            f"choose one with {_OPTION[role]}"
        )
    return None


def detect_columns(
    names: Sequence[str],
    lat: str | None = None,
    lon: str | None = None,
    id: str | bool | None = None,
    geometry: tuple[str, str] | None = None,
) -> ColumnMapping:
    """The mapping of ``names`` (a source's columns) to lat, lon and id.

    Parameters
    ----------
    names : sequence of str
        Column names of the source, in order.
    lat, lon : str, optional
        Explicit column names; detected when None.
    id : str or bool, optional
        Explicit id column; ``False`` (or ``""``) uses row numbers even when an id-like
        column exists; None detects.
    geometry : (str, str), optional
        ``(lat, lon)`` columns decoded from a point geometry; they win over spellings.

    Raises
    ------
    ColumnError
        A named column does not exist, a role is ambiguous, or lat/lon are not found.
    """
    names = list(names)
    picked: dict[str, str | None] = {}
    for role, given, spellings in (("lat", lat, LAT_NAMES), ("lon", lon, LON_NAMES)):
        if given:
            picked[role] = _resolve(names, given, role)
        elif geometry is not None:
            picked[role] = geometry[0] if role == "lat" else geometry[1]
        else:
            picked[role] = _detect(names, spellings, role)
            if picked[role] is None:
                raise ColumnError(
                    f"no {role} column found: looked for {', '.join(spellings)} "
                    f"(any case); columns found: {', '.join(names) or '(none)'}; "
                    f"name it with {_OPTION[role]}"
                )
    if id is False or id == "":
        picked["id"] = None
    elif isinstance(id, str):
        picked["id"] = _resolve(names, id, "id")
    else:
        picked["id"] = _detect(names, ID_NAMES, "id")
    if picked["lat"] == picked["lon"]:
        raise ColumnError(f"lat and lon are both column {picked['lat']!r}; they must differ")
    if picked["id"] in (picked["lat"], picked["lon"]):
        raise ColumnError(f"column {picked['id']!r} cannot be the id and a coordinate")
    mapped = {v for v in picked.values() if v is not None}
    renamed = {}
    for name in names:
        if name in RESERVED and name not in mapped:
            new = name + RENAMED_SUFFIX
            while new in names:
                new += "_"
            renamed[name] = new
    lat_name, lon_name = picked["lat"], picked["lon"]
    assert lat_name is not None and lon_name is not None
    return ColumnMapping(lat=lat_name, lon=lon_name, id=picked["id"], renamed=renamed)


def coordinate_candidates(
    names: Sequence[str], lat: str | None = None, lon: str | None = None
) -> list[str]:
    """Every column that may end up a coordinate (readers parse these as text first)."""
    out = candidates(names, LAT_NAMES + LON_NAMES)
    for given in (lat, lon):
        if given:
            out += [n for n in names if n.lower() == given.lower()]
    return list(dict.fromkeys(out))
