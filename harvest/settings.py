"""Declared settings: each setting is one frozen-dataclass field carrying its own metadata.

A field made with :func:`setting` declares its kind (:class:`Number`, :class:`Integer`,
:class:`Text`, ...), the YAML words that stand for a value (``auto`` for ``None``), whether
``null`` is allowed, and one line of description. From that one declaration come
:func:`validate` (run by every settings dataclass in ``__post_init__``, so a direct
construction is checked exactly as a loaded file is), :func:`from_mapping` (nested
sections, unknown keys refused, a bad value reported by its path from the root),
:func:`to_mapping`, :func:`json_schema` and :func:`argument` (a mirroring CLI flag). Rules
between fields stay explicit ``__post_init__`` checks raised with :func:`invalid`.
Standard library only (harvest.schedule declares its knobs with it; pydantic is absent on
the GPU image).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import abc
from pathlib import Path
from typing import Any, Iterator, Mapping

from harvest.setting_kinds import (Boolean, Endpoint, FilePath, Host, Integer, Kind, ListOf, Mismatch, Number, Port,
                                   Switch, Text)

__all__ = ["Boolean", "Endpoint", "FilePath", "Host", "Integer", "ListOf", "Number", "Port", "Switch", "Text", "SettingError", "argument", "from_mapping",
           "invalid", "json_schema", "section", "setting", "setting_of", "setting_paths", "to_mapping", "validate",
           "yaml_problem"]

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

_SETTING = "harvest.setting"  # dataclass field metadata keys
_SECTION = "harvest.section"


class SettingError(ValueError):
    """A bad setting. For a bad value, ``path``/``value``/``expected`` say which (dotted,
    from the document's root), what was given and what is accepted; the message may carry
    a prefix saying where (``"harvest config: "``)."""

    def __init__(self, message: str, *, path: str = "", value: Any = None, expected: str = ""):
        super().__init__(message)
        self.path, self.value, self.expected = path, value, expected

    @classmethod
    def bad_value(cls, path: str, value: Any, expected: str, where: str = "") -> "SettingError":
        return cls(f"{where}{path}={value!r}: expected {expected}", path=path, value=value, expected=expected)

    def relocated(self, where: str, parent: str) -> "SettingError":
        """The same bad value named from further up: ``ring_size`` -> ``qos.ring_size``."""
        if not self.path:
            return self
        return SettingError.bad_value(_join(parent, self.path), self.value, self.expected, where)


# -- declaring settings --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setting:
    """The metadata of one setting field (see :func:`setting`)."""

    description: str
    kind: Kind
    words: Mapping[str, Any]
    nullable: bool

    @property
    def expected(self) -> str:
        options = [repr(word) for word in self.words] + (["null"] if self.nullable else []) + [self.kind.expected]
        return options[0] if len(options) == 1 else f"{', '.join(options[:-1])} or {options[-1]}"

    def convert(self, value: Any, base_dir: Path | None) -> Any:
        """The value as the dataclass holds it; a value already converted passes unchanged.
        ``None`` is taken when null is allowed or a word stands for it (a direct
        construction writes ``reserve_tokens=None``; YAML's null is refused earlier, in
        :func:`from_mapping`, unless ``nullable``)."""
        if isinstance(value, str) and value in self.words:
            return self.words[value]
        if value is None and (self.nullable or any(v is None for v in self.words.values())):
            return None
        return self.kind.convert(value, base_dir)

    def to_yaml(self, value: Any) -> Any:
        for word, meaning in self.words.items():
            if value is meaning or (meaning is not None and value == meaning):
                return word
        to_yaml = getattr(self.kind, "to_yaml", None)  # a kind whose YAML form is not a list or scalar
        return to_yaml(value) if to_yaml is not None else _to_yaml(value)


def _to_yaml(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_to_yaml(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    return value


def setting(default: Any, description: str, kind: Kind, *, words: Mapping[str, Any] | None = None,
            nullable: bool = False) -> Any:
    """A dataclass field declaring one setting: its default, one line saying what it is,
    its kind, the YAML words standing for a value (``{"auto": None}``), and whether YAML's
    ``null`` is a valid value."""
    return dataclasses.field(default=default, metadata={_SETTING: Setting(description, kind, dict(words or {}), nullable)})


def section(settings_class: type, description: str) -> Any:
    """A dataclass field holding a nested settings dataclass (a YAML mapping)."""
    return dataclasses.field(default_factory=settings_class, metadata={_SECTION: (settings_class, description)})


def setting_of(settings_class: type, name: str) -> Setting:
    for field in dataclasses.fields(settings_class):
        if field.name == name and _SETTING in field.metadata:
            return field.metadata[_SETTING]
    raise KeyError(f"{settings_class.__name__}.{name} is not a declared setting")


def setting_paths(settings_class: type, parent: str = "") -> Iterator[tuple[str, Setting]]:
    """Every setting reachable from ``settings_class``, as (dotted path, its metadata), depth first."""
    for field in dataclasses.fields(settings_class):
        if _SECTION in field.metadata:
            yield from setting_paths(field.metadata[_SECTION][0], _join(parent, field.name))
        elif _SETTING in field.metadata:
            yield _join(parent, field.name), field.metadata[_SETTING]


def _join(parent: str, name: str) -> str:
    return f"{parent}.{name}" if parent else name


def _describe(field: dataclasses.Field) -> str:
    """The description and default appended to an error: what the setting is for."""
    spec: Setting = field.metadata[_SETTING]
    return f"{spec.description} (default {_yaml_text(spec.to_yaml(field.default))})"


def _yaml_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _convert(field: dataclasses.Field, value: Any, base_dir: Path | None, path: str, where: str) -> Any:
    spec: Setting = field.metadata[_SETTING]
    try:
        return spec.convert(value, base_dir)
    except Mismatch as mismatch:
        if mismatch.index is not None:
            path, value = f"{path}[{mismatch.index}]", mismatch.value
        expected = mismatch.expected or spec.expected
        raise SettingError.bad_value(path, value, f"{expected}; {_describe(field)}", where) from None


# -- validation of an instance ---------------------------------------------------------------
def validate(instance: Any) -> None:
    """Check and normalise every setting of a settings dataclass; call in ``__post_init__``.

    Messages name ``<Class>.<field>``; :func:`from_mapping` renames them by YAML path."""
    where = f"{type(instance).__name__}."
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if _SETTING in field.metadata:
            converted = _convert(field, value, None, field.name, where)
            if converted is not value:
                object.__setattr__(instance, field.name, converted)  # frozen: normalise once, here
        elif _SECTION in field.metadata:
            section_class = field.metadata[_SECTION][0]
            if not isinstance(value, section_class):
                raise SettingError.bad_value(field.name, value, f"a {section_class.__name__}", where)


def invalid(instance: Any, name: str, expected: str) -> SettingError:
    """The error of a rule between fields, in the form :func:`validate` uses: name the
    field whose value breaks it and say the fix in ``expected``."""
    return SettingError.bad_value(name, getattr(instance, name), expected, f"{type(instance).__name__}.")


# -- loading from a parsed YAML/JSON mapping ------------------------------------------------
def yaml_problem(error: Exception) -> str:
    """A YAML parse error (PyYAML's ``MarkedYAMLError``, also what OmegaConf raises) in one
    line: ``line 2, column 1: expected ',' or ']' (while parsing a flow sequence)``. PyYAML's
    own text spans several lines and quotes the document; every YAML file harvest reads
    reports its errors through this."""
    problem = getattr(error, "problem", None)
    if problem is None:
        return " ".join(str(error).split())
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(error, "context", None)
    return f"{where}{problem}" + (f" ({context})" if context else "")


def from_mapping(settings_class: type, raw: Any, *, where: str = "", path: str = "", base_dir: Path | None = None,
                 extra: Mapping[str, Any] | None = None) -> Any:
    """Build ``settings_class`` from a parsed mapping: nested sections recursively, unknown
    keys refused (naming the known ones), renamed keys named with their new name (a class's
    ``RENAMED_SETTINGS``), every bad value named by its ``path`` from the document root.
    ``where`` prefixes every message; ``extra`` passes fields that are not settings.
    Raises :class:`SettingError`."""
    if raw is None:
        raw = {}  # an empty section (``qos:``) means its defaults
    if not isinstance(raw, abc.Mapping):
        if path:
            raise SettingError.bad_value(path, raw, "a mapping", where)
        raise SettingError(f"{where}expected a mapping of settings, got {type(raw).__name__}")
    fields = [f for f in dataclasses.fields(settings_class) if _SETTING in f.metadata or _SECTION in f.metadata]
    known = [f.name for f in fields]
    renamed = getattr(settings_class, "RENAMED_SETTINGS", {})
    for key in raw:
        if key in renamed:
            raise SettingError(f"{where}{_join(path, key)} is now {_join(path, renamed[key])}: rename the key "
                               f"(known: {', '.join(known)})")
    unknown = sorted(str(key) for key in raw if key not in known)
    if unknown:
        raise SettingError(f"{where}unknown key(s) {', '.join(_join(path, key) for key in unknown)} "
                           f"(known: {', '.join(known)})")
    values = dict(extra or {})
    for field in fields:
        if field.name not in raw:
            continue
        value, field_path = raw[field.name], _join(path, field.name)
        if _SECTION in field.metadata:
            values[field.name] = from_mapping(field.metadata[_SECTION][0], value, where=where, path=field_path, base_dir=base_dir)
            continue
        if value is None and not field.metadata[_SETTING].nullable:
            raise SettingError.bad_value(field_path, value, f"{field.metadata[_SETTING].expected}; {_describe(field)}", where)
        values[field.name] = _convert(field, value, base_dir, field_path, where)
    try:
        return settings_class(**values)
    except SettingError as error:  # a rule between fields, named from the document root
        raise error.relocated(where, path) from None


def to_mapping(instance: Any) -> dict[str, Any]:
    """The YAML form of a settings dataclass: :func:`from_mapping` gives it back."""
    out = {}
    for field in dataclasses.fields(instance):
        value = getattr(instance, field.name)
        if _SECTION in field.metadata:
            out[field.name] = to_mapping(value)
        elif _SETTING in field.metadata:
            out[field.name] = field.metadata[_SETTING].to_yaml(value)
    return out


# -- JSON Schema -----------------------------------------------------------------------------
def json_schema(settings_class: type, *, title: str, description: str) -> dict[str, Any]:
    """A JSON Schema (draft 2020-12) of the YAML :func:`from_mapping` accepts for
    ``settings_class``. Rules between fields and file existence are beyond it."""
    return {"$schema": JSON_SCHEMA_DIALECT, "title": title, "description": description, **_object_schema(settings_class)}


def _object_schema(settings_class: type) -> dict[str, Any]:
    properties = {}
    for field in dataclasses.fields(settings_class):
        if _SECTION in field.metadata:
            section_class, text = field.metadata[_SECTION]
            properties[field.name] = {"description": text, **_object_schema(section_class), "type": ["object", "null"]}
        elif _SETTING in field.metadata:
            properties[field.name] = _setting_schema(field)
    return {"type": "object", "additionalProperties": False, "properties": properties}


def _setting_schema(field: dataclasses.Field) -> dict[str, Any]:
    spec: Setting = field.metadata[_SETTING]
    options = [{"const": word} for word in spec.words] + ([{"type": "null"}] if spec.nullable else []) + [spec.kind.schema()]
    value_schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {"description": spec.description, "default": spec.to_yaml(field.default), **value_schema}


# -- command-line flags mirroring a setting ----------------------------------------------------
def argument(settings_class: type, name: str, *, yaml_path: str) -> dict[str, Any]:
    """``parser.add_argument`` keywords for a flag mirroring setting ``name``: its default,
    its description as help (naming ``yaml_path`` to match), and a type that validates as
    the setting does."""
    field = next(f for f in dataclasses.fields(settings_class) if f.name == name and _SETTING in f.metadata)
    spec: Setting = field.metadata[_SETTING]

    def parse(text: str) -> Any:
        try:
            return spec.convert(spec.kind.parse_text(text), None)
        except (ValueError, Mismatch):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {spec.expected}") from None

    return {"type": parse, "default": field.default,
            "help": f"{spec.description}; match harvest.yaml {yaml_path} (default {_yaml_text(spec.to_yaml(field.default))})"}
