"""Attribute filters as the client takes them (``where=``), and as the command line does.

``where`` has the form pyarrow and Dask take as ``filters=``: a list of
``(column, op, value)`` tuples, ANDed, or a list of such lists, ORed::

    where=[("country", "==", "FR"), ("pop", ">=", 10_000)]
    where=[[("kind", "in", ["a", "b"])], [("pop", ">", 1e6)]]

Ops: ``==`` (or ``=``), ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``in``, ``not in``. Values:
bool, int, float, str, and timestamps (``datetime``, ``date``, ``pandas.Timestamp``,
``numpy.datetime64``; naive ones are UTC). The server types them against the columns
and refuses a mismatch with InvalidArgument naming the column.

On the command line, ``--where "pop >= 10000"`` is one predicate (``parse_expression``);
several ``--where`` are ANDed, and ``--or-where`` starts another group, ORed.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from geonear.v1 import geonear_pb2 as pb

#: The ops by their names in ``where`` and in the contract.
OPS: dict[str, pb.FilterOp] = {
    "==": pb.FILTER_OP_EQ,
    "!=": pb.FILTER_OP_NE,
    "<": pb.FILTER_OP_LT,
    "<=": pb.FILTER_OP_LE,
    ">": pb.FILTER_OP_GT,
    ">=": pb.FILTER_OP_GE,
    "in": pb.FILTER_OP_IN,
    "not in": pb.FILTER_OP_NOT_IN,
}
_INT64 = (-(2**63), 2**63 - 1)
_SHAPE = "where: give a list of (column, op, value) tuples, ANDed, or a list of such lists, ORed"


def filter_message(where: Any) -> pb.Filter | None:
    """``where`` as the contract's Filter; None for no filter (None or an empty list).

    Raises ValueError (or TypeError for a value of no filterable type) before anything
    is sent.
    """
    if where is None:
        return None
    if isinstance(where, str | bytes) or not isinstance(where, Sequence):
        raise ValueError(f"{_SHAPE}; got {type(where).__name__}")
    items = list(where)
    if not items:
        return None
    first = items[0]
    flat = isinstance(first, Sequence) and len(first) > 0 and isinstance(first[0], str)
    message = pb.Filter()
    for group in [items] if flat else items:
        if isinstance(group, str | bytes) or not isinstance(group, Sequence) or not group:
            raise ValueError(f"{_SHAPE}; got {group!r}")
        conjunction = message.any_of.add()
        for item in group:
            conjunction.all_of.append(_predicate(item))
    return message


def _predicate(item: Any) -> pb.Predicate:
    if isinstance(item, str | bytes) or not isinstance(item, Sequence) or len(item) != 3:
        raise ValueError(f"where: a predicate is a (column, op, value) tuple; got {item!r}")
    column, op, value = item
    if not isinstance(column, str) or not column:
        raise ValueError(f"where: a predicate's column is a name; got {column!r}")
    name = "==" if op == "=" else str(op).lower()
    if name not in OPS:
        raise ValueError(f"where: unknown op {op!r} on {column!r}; choose one of {', '.join(OPS)}")
    predicate = pb.Predicate(column=column, op=OPS[name])
    listed = isinstance(value, list | tuple | set | frozenset | np.ndarray)
    if name in ("in", "not in"):
        if not listed:
            raise ValueError(f"where: {column!r} {name} takes a list of values; got {value!r}")
        predicate.values.SetInParent()
        for v in value:
            predicate.values.values.append(value_message(v, column))
    else:
        if listed:
            raise ValueError(f"where: {column!r} {name} takes one value; use 'in' for a list")
        predicate.value.CopyFrom(value_message(value, column))
    return predicate


def value_message(value: Any, column: str = "") -> pb.Value:
    """One filter value as the contract's typed Value."""
    if isinstance(value, bool | np.bool_):
        return pb.Value(bool_value=bool(value))
    if isinstance(value, int | np.integer):
        number = int(value)
        if not _INT64[0] <= number <= _INT64[1]:
            # Beyond every int64 value, so as a double it compares the same with them.
            return pb.Value(float_value=float(number))
        return pb.Value(int_value=number)
    if isinstance(value, float | np.floating):
        return pb.Value(float_value=float(value))
    if isinstance(value, str):
        return pb.Value(string_value=value)
    nanos = _epoch_nanoseconds(value)
    if nanos is None:
        raise TypeError(
            f"where: {column!r}: a value is a bool, number, string or timestamp; got "
            f"{type(value).__name__} {value!r}"
        )
    seconds, rest = divmod(nanos, 10**9)
    value_msg = pb.Value()
    value_msg.timestamp_value.seconds = seconds
    value_msg.timestamp_value.nanos = rest
    return value_msg


def _epoch_nanoseconds(value: Any) -> int | None:
    """A timestamp as nanoseconds since 1970-01-01 UTC (naive means UTC); None if not one."""
    if isinstance(value, np.datetime64):
        if np.isnat(value):
            raise ValueError("where: NaT never matches; give a timestamp")
        return int(value.astype("datetime64[ns]").astype(np.int64))
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        value = dt.datetime.combine(value, dt.time())
    if not isinstance(value, dt.datetime):
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    delta = value - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    nanos = int(getattr(value, "nanosecond", 0))  # pandas' Timestamp carries them
    return (delta.days * 86_400 + delta.seconds) * 10**9 + delta.microseconds * 1000 + nanos


# -- the command line's expressions ----------------------------------------------------
_EXPRESSION = re.compile(
    r"^\s*(?P<column>[^\s=!<>]+|\"[^\"]+\"|`[^`]+`)\s*"
    r"(?P<op>==|=|!=|<=|>=|<|>|not\s+in\b|in\b)\s*(?P<value>.*?)\s*$",
    re.IGNORECASE | re.DOTALL,
)
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$|^[+-]?inf$", re.IGNORECASE)
_EXAMPLES = "e.g. \"country == 'FR'\", 'pop >= 10000', \"kind in ('a', 'b')\""


def parse_expression(text: str) -> tuple[str, str, Any]:
    """One ``--where`` expression as a ``(column, op, value)`` predicate.

    ``COLUMN OP VALUE`` with OP one of ==, =, !=, <, <=, >, >=, in, not in. A value is
    a number (10000, 2.5, -1e3), true or false, a quoted string ('FR' or "FR"), a bare
    word (FR), or for in / not in a list in brackets: ('a', 'b') or [1, 2]. Quote a
    string that looks like a number ('007'). Column names with spaces go in backquotes.
    """
    match = _EXPRESSION.match(text)
    if match is None or not match.group("value"):
        raise ValueError(f"--where {text!r}: write COLUMN OP VALUE, {_EXAMPLES}")
    column = match.group("column").strip('"`')
    op = " ".join(match.group("op").lower().split())
    op = "==" if op == "=" else op
    raw = match.group("value")
    if op in ("in", "not in"):
        if raw[0] + raw[-1] not in ("()", "[]"):
            raise ValueError(
                f"--where {text!r}: {op} takes a list in brackets, e.g. \"kind in ('a', 'b')\""
            )
        return column, op, [_literal(part, text) for part in _split_list(raw[1:-1], text)]
    return column, op, _literal(raw, text)


def _split_list(body: str, text: str) -> list[str]:
    parts, current, quote = [], "", ""
    for char in body:
        if quote:
            current += char
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
            current += char
        elif char == ",":
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if quote:
        raise ValueError(f"--where {text!r}: a quote is not closed")
    if current.strip():
        parts.append(current.strip())
    if any(not part for part in parts):
        raise ValueError(f"--where {text!r}: an empty item in the list")
    return parts


def _literal(raw: str, text: str) -> Any:
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\"":
        return raw[1:-1]
    if raw[:1] in "'\"":
        raise ValueError(f"--where {text!r}: a quote is not closed")
    if _NUMBER.match(raw):
        number = float(raw)
        if re.fullmatch(r"[+-]?\d+", raw):
            return int(raw)
        return number
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    if re.search(r"[\s,()\[\]]", raw):
        raise ValueError(f"--where {text!r}: quote a value with spaces or commas: '{raw}'")
    return raw


def where_from_arguments(
    items: Sequence[tuple[str, str]] | None,
) -> list[list[tuple[str, str, Any]]] | None:
    """Command-line expressions as a ``where=`` filter; None when there are none.

    ``items`` are ``("and", EXPR)`` for ``--where`` and ``("or", EXPR)`` for
    ``--or-where``, in command-line order: ``--where`` adds to the current group (ANDed),
    ``--or-where`` starts a new one, ORed with those before it. So
    ``--where A --where B --or-where C`` reads (A and B) or C.
    """
    groups: list[list[tuple[str, str, Any]]] = []
    for kind, expression in items or ():
        if kind == "or" or not groups:
            groups.append([])
        groups[-1].append(parse_expression(expression))
    return groups or None
