"""What values a setting takes: its *kind*. Each kind converts a value (a parsed YAML value
or one given in Python; an already converted value passes unchanged), says what it
accepts in words for error messages, and gives its JSON Schema.

Standard library only (see :mod:`harvest.settings`); addresses are parsed by
:mod:`harvest.addresses`, standard library only too.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import abc
from pathlib import Path
from typing import Any, Protocol

from harvest import addresses


class Kind(Protocol):
    """The contract :mod:`harvest.settings` relies on. ``convert`` raises :class:`Mismatch`
    for a value it does not accept; ``base_dir`` is where relative paths start (None: the
    working directory). Kinds used for command-line flags also have ``parse_text``."""

    @property
    def expected(self) -> str: ...

    def convert(self, value: Any, base_dir: Path | None) -> Any: ...

    def schema(self) -> dict: ...


class Mismatch(Exception):
    """Raised by a kind: the value is not acceptable. ``expected`` replaces the kind's own
    phrase where the failure needs more (a missing file's resolved path); ``index`` names
    the list item at fault."""

    def __init__(self, expected: str | None = None, index: int | None = None, value: Any = None):
        super().__init__(expected)
        self.expected, self.index, self.value = expected, index, value


def _interval(minimum, maximum, exclusive_minimum: bool, exclusive_maximum: bool) -> str:
    if minimum is not None and maximum is not None:
        return f" in {'(' if exclusive_minimum else '['}{minimum!r}, {maximum!r}{')' if exclusive_maximum else ']'}"
    if minimum is not None:
        return f" {'>' if exclusive_minimum else '>='} {minimum!r}"
    if maximum is not None:
        return f" {'<' if exclusive_maximum else '<='} {maximum!r}"
    return ""


def _bounds_schema(minimum, maximum, exclusive_minimum: bool, exclusive_maximum: bool) -> dict:
    schema = {}
    if minimum is not None:
        schema["exclusiveMinimum" if exclusive_minimum else "minimum"] = minimum
    if maximum is not None:
        schema["exclusiveMaximum" if exclusive_maximum else "maximum"] = maximum
    return schema


def _outside(value, minimum, maximum, exclusive_minimum: bool, exclusive_maximum: bool) -> bool:
    if minimum is not None and (value <= minimum if exclusive_minimum else value < minimum):
        return True
    return maximum is not None and (value >= maximum if exclusive_maximum else value > maximum)


# A name harvest shows outside (a job, a served adapter, a fleet job): a Prometheus label
# value, a URL path segment and an SGLang LoRA name all accept it.
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}"
NAME_EXPECTED = "1-64 letters, digits, '_', '.' or '-', starting with a letter or digit"

@dataclasses.dataclass(frozen=True)
class Number:
    """A finite number (an integer is taken as a float)."""

    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False

    @property
    def expected(self) -> str:
        return "a finite number" + _interval(self.minimum, self.maximum, self.exclusive_minimum, self.exclusive_maximum)

    def convert(self, value: Any, base_dir: Path | None) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise Mismatch()
        if _outside(value, self.minimum, self.maximum, self.exclusive_minimum, self.exclusive_maximum):
            raise Mismatch()
        return float(value)

    def parse_text(self, text: str) -> float:
        return float(text)

    def schema(self) -> dict:
        return {"type": "number", **_bounds_schema(self.minimum, self.maximum, self.exclusive_minimum, self.exclusive_maximum)}


@dataclasses.dataclass(frozen=True)
class Integer:
    """An integer within inclusive bounds (``True`` and ``2.0`` are not integers here)."""

    minimum: int | None = None
    maximum: int | None = None

    @property
    def expected(self) -> str:
        return "an integer" + _interval(self.minimum, self.maximum, False, False)

    def convert(self, value: Any, base_dir: Path | None) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or _outside(value, self.minimum, self.maximum, False, False):
            raise Mismatch()
        return value

    def parse_text(self, text: str) -> int:
        return int(text)

    def schema(self) -> dict:
        return {"type": "integer", **_bounds_schema(self.minimum, self.maximum, False, False)}


@dataclasses.dataclass(frozen=True)
class Boolean:
    expected = "true or false"

    def convert(self, value: Any, base_dir: Path | None) -> bool:
        if not isinstance(value, bool):
            raise Mismatch()
        return value

    def schema(self) -> dict:
        return {"type": "boolean"}


@dataclasses.dataclass(frozen=True)
class Switch:
    """``auto``, ``on`` or ``off``. YAML 1.1 (PyYAML's) reads an unquoted on/off as a
    boolean: true and false are taken for on and off."""

    expected = "auto, on or off"
    CHOICES = ("auto", "on", "off")

    def convert(self, value: Any, base_dir: Path | None) -> str:
        if isinstance(value, bool):
            return "on" if value else "off"
        if not isinstance(value, str) or value not in self.CHOICES:
            raise Mismatch()
        return value

    def parse_text(self, text: str) -> str:
        return text

    def schema(self) -> dict:
        return {"anyOf": [{"type": "string", "enum": list(self.CHOICES)}, {"type": "boolean"}]}


@dataclasses.dataclass(frozen=True)
class Text:
    """A string matching ``pattern`` (a full match); ``expected`` says it for people."""

    pattern: str
    expected: str

    def convert(self, value: Any, base_dir: Path | None) -> str:
        if not isinstance(value, str) or re.fullmatch(self.pattern, value) is None:
            raise Mismatch()
        return value

    def parse_text(self, text: str) -> str:
        return text

    def schema(self) -> dict:
        return {"type": "string", "pattern": f"^(?:{self.pattern})$"}


# An IPv6 address's shape for JSON Schema (addresses.parse_* decide what is valid).
IPV6_PATTERN = r"[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*(%[A-Za-z0-9_.-]+)?"


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """A ``HOST:PORT`` or ``[IPv6]:PORT`` string (harvest.addresses), kept as written."""

    expected = f"HOST:PORT or [IPv6]:PORT, {addresses.port_rule()}"

    def convert(self, value: Any, base_dir: Path | None) -> str:
        try:
            addresses.parse_address(value)
        except addresses.AddressError as error:
            raise Mismatch(f"HOST:PORT ({error.reason})") from None
        return value

    def parse_text(self, text: str) -> str:
        return text

    def schema(self) -> dict:
        host = rf"{addresses.NAME_PATTERN}|\[{IPV6_PATTERN}\]"
        return {"type": "string", "pattern": f"^(?:{host}):{PORT_PATTERN}$"}


@dataclasses.dataclass(frozen=True)
class Host:
    """A host name, IPv4 or IPv6 address (harvest.addresses.parse_host); an IPv6 address
    given in brackets is kept without them."""

    expected = "a host name or IP address"

    def convert(self, value: Any, base_dir: Path | None) -> str:
        try:
            return addresses.parse_host(value)
        except addresses.AddressError as error:
            raise Mismatch(f"{self.expected} ({error.reason})") from None

    def parse_text(self, text: str) -> str:
        return text

    def schema(self) -> dict:
        return {"type": "string", "pattern": f"^(?:{addresses.NAME_PATTERN}|{IPV6_PATTERN}|\\[{IPV6_PATTERN}\\])$"}


@dataclasses.dataclass(frozen=True)
class Port:
    """A TCP port, 1-65535; 0 too when ``zero`` says what it means (``"off"``)."""

    zero: str | None = None

    @property
    def expected(self) -> str:
        return f"a port ({addresses.port_rule(self.zero)})"

    def convert(self, value: Any, base_dir: Path | None) -> int:
        if isinstance(value, str):  # as Integer: YAML writes a port as a number, not "18400"
            raise Mismatch()
        try:
            return addresses.parse_port(value, zero=self.zero)
        except addresses.AddressError:
            raise Mismatch() from None

    def parse_text(self, text: str) -> int:
        try:
            return addresses.parse_port(text, zero=self.zero)
        except addresses.AddressError as error:
            raise ValueError(str(error)) from None

    def schema(self) -> dict:
        return {"type": "integer", "minimum": 0 if self.zero else 1, "maximum": addresses.MAX_PORT}


# 1-65535 without leading zeros: what addresses.parse_port accepts, for JSON Schema.
PORT_PATTERN = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"


@dataclasses.dataclass(frozen=True)
class FilePath:
    """A path; a relative one is taken from ``base_dir`` (the YAML file's directory) when
    loading, else from the working directory. ``must_exist``: refused if nothing is there."""

    must_exist: bool = True
    expected = "a path string"

    def convert(self, value: Any, base_dir: Path | None) -> Path:
        if not isinstance(value, (str, Path)) or not str(value):
            raise Mismatch()
        path = Path(value).expanduser()
        if base_dir is not None and not path.is_absolute():
            path = base_dir / path
        if self.must_exist and not path.exists():
            raise Mismatch(f"an existing file; not found: {path}")
        return path

    def schema(self) -> dict:
        return {"type": "string", "minLength": 1}


@dataclasses.dataclass(frozen=True)
class ListOf:
    """A list of ``item`` values, kept as a tuple. ``one_as_list``: a single item is taken as
    a list of one; ``descending``: kept sorted largest first."""

    item: Any
    non_empty: bool = False
    distinct: bool = False
    descending: bool = False
    one_as_list: bool = False

    @property
    def expected(self) -> str:
        listed = ("a non-empty list" if self.non_empty else "a list") + (" of distinct items" if self.distinct else "")
        listed += f", each {self.item.expected}"
        return f"{self.item.expected} or {listed}" if self.one_as_list else listed

    def convert(self, value: Any, base_dir: Path | None) -> tuple:
        if self.one_as_list and not isinstance(value, (list, tuple, abc.Mapping)):
            value = [value]  # a single item: ``jobs: a.yaml``
        if not isinstance(value, (list, tuple)) or (self.non_empty and not value):
            raise Mismatch()
        items = []
        for index, item in enumerate(value):
            try:
                items.append(self.item.convert(item, base_dir))
            except Mismatch as mismatch:
                raise Mismatch(mismatch.expected or self.item.expected, index, item) from None
        if self.distinct and len(set(items)) != len(items):
            raise Mismatch()
        return tuple(sorted(items, reverse=True)) if self.descending else tuple(items)

    def schema(self) -> dict:
        array = {"type": "array", "items": self.item.schema()}
        if self.non_empty:
            array["minItems"] = 1
        if self.distinct:
            array["uniqueItems"] = True
        return {"anyOf": [self.item.schema(), array]} if self.one_as_list else array


@dataclasses.dataclass(frozen=True)
class LabelSet:
    """A mapping of Prometheus label names to string values (kept as a sorted tuple of
    pairs: settings are frozen). ``reserved``: names harvest itself uses."""

    reserved: tuple[str, ...] = ()

    @property
    def expected(self) -> str:
        taken = f", none of {', '.join(self.reserved)}" if self.reserved else ""
        return ("a mapping of label names (letters, digits and '_', not starting with a digit or '__'"
                f"{taken}) to strings")

    def convert(self, value: Any, base_dir: Path | None) -> tuple:
        if isinstance(value, tuple) and all(isinstance(pair, tuple) and len(pair) == 2 for pair in value):
            value = dict(value)
        if not isinstance(value, abc.Mapping):
            raise Mismatch()
        for name, text in value.items():
            if (not isinstance(name, str) or re.fullmatch(LABEL_NAME_PATTERN, name) is None or name.startswith("__")
                    or name in self.reserved or not isinstance(text, str)):
                raise Mismatch()
        return tuple(sorted(value.items()))

    def to_yaml(self, value: tuple) -> dict:
        return dict(value)

    def schema(self) -> dict:
        return {"type": "object", "propertyNames": {"pattern": f"^{LABEL_NAME_PATTERN}$",
                                                    "not": {"enum": list(self.reserved)}},
                "additionalProperties": {"type": "string"}}


LABEL_NAME_PATTERN = r"[a-zA-Z_][a-zA-Z0-9_]*"
