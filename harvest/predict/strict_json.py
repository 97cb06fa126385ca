"""Strict conversion between JSON objects and frozen dataclasses.

Profiles are read by a serving process that must refuse a damaged or foreign file rather
than run on guessed values, so conversion is strict: every field present, no unknown
keys, every value of the declared type (``int`` never accepts ``bool`` or ``1.0``, nor a
value outside 64 bits; ``float`` accepts integers and nothing non-finite, including a
literal too large for a double such as ``1e309``, which JSON parsers read as infinity),
errors naming the JSON path of the offending value (a NaN or Infinity token, or an
object naming a key twice, too).
Supported annotations: str, int, float, bool, ``X | None``, ``tuple[X, ...]``,
``dict[str, X]``, dataclasses (recursively) and classes with a ``from_dict`` classmethod.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing


class StrictJsonError(ValueError):
    """A value does not match the schema; the message starts with its JSON path."""


# JSON integers beyond 64 bits are no count or index any writer of ours produces, and
# most readers cannot hold them (float() of one overflows).
INT_RANGE = (-(2**63), 2**63 - 1)


class _Refused:
    """What parsing met and must refuse (a NaN/Infinity token, an object naming a key
    twice), held in place so the refusal can name its JSON path."""

    def __init__(self, problem: str):
        self.problem = problem


class _ObjectWithDuplicate(dict):
    def __init__(self, pairs: list, problem: str):
        super().__init__(pairs)
        self.duplicate = _Refused(problem)


def _first_refused(value, path: str):
    if isinstance(value, _Refused):
        return path, value.problem
    if isinstance(value, _ObjectWithDuplicate):
        return path, value.duplicate.problem
    if isinstance(value, dict):
        items = ((f"{path}.{k}", v) for k, v in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{i}]", v) for i, v in enumerate(value))
    else:
        return None
    for child_path, child in items:
        found = _first_refused(child, child_path)
        if found is not None:
            return found
    return None


def loads(text: str, root: str = "$"):
    """``json.loads`` that refuses NaN and Infinity instead of turning them into floats,
    and an object naming a key twice instead of keeping the last; the error names the
    first one's JSON path (from ``root``)."""
    refused: list[str] = []

    def constant(name: str) -> _Refused:
        refused.append(f"{name} is not valid JSON (a measurement that failed?)")
        return _Refused(refused[-1])

    def object_from(pairs: list) -> dict:
        keys = [key for key, _ in pairs]
        if len(set(keys)) == len(keys):
            return dict(pairs)
        twice = next(key for index, key in enumerate(keys) if key in keys[:index])
        refused.append(f"names {twice!r} twice (which one is meant?)")
        return _ObjectWithDuplicate(pairs, refused[-1])

    value = json.loads(text, parse_constant=constant, object_pairs_hook=object_from)
    if refused:
        where, problem = _first_refused(value, root) or (root, refused[0])
        raise StrictJsonError(f"{where}: {problem}")
    return value


def _shown(value) -> str:
    """``value`` for an error message: short, and never the repr of a huge or deep value."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, int) and not isinstance(value, bool) and not INT_RANGE[0] <= value <= INT_RANGE[1]:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def dumps(value, indent: int = 1, _level: int = 0) -> str:
    """Indented JSON with every *flat* value (a scalar, a list of scalars, an object of
    those) on one line: a profile's hundreds of raw latencies stay one line per grid
    point instead of one line per number. NaN and Infinity are refused."""
    if _is_flat(value):
        return json.dumps(value, allow_nan=False, separators=(", ", ": "))
    pad, inner = " " * (indent * _level), " " * (indent * (_level + 1))
    if isinstance(value, dict):
        items = [f"{inner}{json.dumps(k)}: {dumps(v, indent, _level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    items = [f"{inner}{dumps(v, indent, _level + 1)}" for v in value]
    return "[\n" + ",\n".join(items) + "\n" + pad + "]"


def dumps_line(value) -> str:
    """Compact one-line JSON (for JSON-lines files); NaN and Infinity refused."""
    return json.dumps(value, allow_nan=False, separators=(",", ":"))


def _is_scalar(value) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _is_flat(value) -> bool:
    if _is_scalar(value):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_scalar(v) for v in value)
    if isinstance(value, dict):
        return all(_is_scalar(v) or (isinstance(v, (list, tuple)) and all(_is_scalar(x) for x in v)) for v in value.values())
    raise TypeError(f"strict_json.dumps: cannot serialise {type(value).__name__}")


def to_jsonable(value):
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if dataclasses.is_dataclass(value):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    return value


def from_jsonable(annotation, value, path: str):
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return from_jsonable(inner, value, path)
    if origin is tuple:
        if not isinstance(value, list):
            raise StrictJsonError(f"{path}: expected a list, got {_shown(value)}")
        return tuple(from_jsonable(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise StrictJsonError(f"{path}: expected an object, got {_shown(value)}")
        return {k: from_jsonable(args[1], v, f"{path}.{k}") for k, v in value.items()}
    if annotation is bool:
        if not isinstance(value, bool):
            raise StrictJsonError(f"{path}: expected true or false, got {_shown(value)}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise StrictJsonError(f"{path}: expected an integer, got {_shown(value)}")
        if not INT_RANGE[0] <= value <= INT_RANGE[1]:
            raise StrictJsonError(f"{path}: expected an integer within 64 bits, got {_shown(value)}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise StrictJsonError(f"{path}: expected a finite number, got {_shown(value)}")
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            overflow = " (too large for a double)" if math.isinf(number) else ""
            raise StrictJsonError(f"{path}: expected a finite number, got {_shown(value)}{overflow}")
        return number
    if annotation is str:
        if not isinstance(value, str):
            raise StrictJsonError(f"{path}: expected a string, got {_shown(value)}")
        return value
    if dataclasses.is_dataclass(annotation) and not hasattr(annotation, "from_dict"):
        return dataclass_from_dict(annotation, value, path)
    if hasattr(annotation, "from_dict"):
        if not isinstance(value, dict):
            raise StrictJsonError(f"{path}: expected an object, got {_shown(value)}")
        try:
            return annotation.from_dict(value)
        except (ValueError, TypeError, KeyError) as exc:
            raise StrictJsonError(f"{path}: {exc}") from exc
    raise TypeError(f"strict_json: unsupported annotation {annotation!r} at {path}")


def dataclass_from_dict(cls, value, path: str):
    """Build dataclass ``cls`` from a JSON object, checking every field (see module doc)."""
    if not isinstance(value, dict):
        raise StrictJsonError(f"{path}: expected an object, got {_shown(value)}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    missing = [n for n in names if n not in value]
    unknown = [k for k in value if k not in names]
    if missing:
        raise StrictJsonError(f"{path}: missing field(s) {', '.join(missing)}")
    if unknown:
        raise StrictJsonError(f"{path}: unknown field(s) {', '.join(unknown)}")
    kwargs = {n: from_jsonable(hints[n], value[n], f"{path}.{n}") for n in names}
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)  # a cross-field check may name its own path under this one
        raise StrictJsonError(message if message.startswith(path) else f"{path}: {message}") from exc
