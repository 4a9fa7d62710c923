"""Declared options: what a part (a model adapter, a sampler, a reward) takes, typed and ranged, checked
against a recipe's values before anything is built.

A part declares its options where it uses them, as typed keyword parameters: the fields of a sampler's
dataclass, the constructor of a reward, a model adapter's ``from_pretrained`` and ``__init__``. A range or
a set of values rides on the annotation::

    max_sequence_length: Annotated[int, AtLeast(1)] = 256
    schedule: Literal["diffusers", "linear"] = "diffusers"

:func:`declared` reads a callable or dataclass into :class:`Option` records; :func:`check_options` holds
the values a recipe gives (YAML scalars, lists, mappings) against them: an unknown key (with the closest
valid one), a wrong type or a value out of range is one ``ValueError`` line that names the key and says
what is valid. Nothing here imports a part: the registries (``flowrl.pipelines``, ``flowrl.rewards``,
``flowrl.registry.SAMPLERS``) ask their parts for the declaration.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import inspect
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, Optional, Sequence, Union

_NO_DEFAULT = inspect.Parameter.empty


# ---------------------------------------------------------------------------------------- constraints
class Constraint:
    """A condition on a value beyond its type: :meth:`ok` tells, :meth:`describe` says it in words (a
    subclass's ``why``, when set, is said after it: why the range is what it is)."""

    why: str = ""

    def ok(self, value: Any) -> bool:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class AtLeast(Constraint):
    """A number ``>= minimum`` (``> minimum`` when ``strict``)."""

    minimum: float
    strict: bool = False
    why: str = ""

    def ok(self, value) -> bool:
        return value > self.minimum if self.strict else value >= self.minimum

    def describe(self) -> str:
        return f"{'>' if self.strict else '>='} {self.minimum:g}"


@dataclass(frozen=True)
class Between(Constraint):
    """A number in ``[low, high]`` (open at an end marked open)."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    why: str = ""

    def ok(self, value) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


@dataclass(frozen=True)
class OneOf(Constraint):
    """A value among ``values`` (a registry's names, read when checked: ``values`` may be a callable)."""

    values: Union[Sequence[Any], Callable[[], Sequence[Any]]]
    why: str = ""

    def names(self) -> list:
        return list(self.values() if callable(self.values) else self.values)

    def ok(self, value) -> bool:
        return value in self.names()

    def describe(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.names())


@dataclass(frozen=True)
class DeviceName(Constraint):
    """A device torch can name: ``cpu``, ``cuda``, ``cuda:1``, ``mps``, ... (parsed, not looked for)."""

    def ok(self, value) -> bool:
        import torch

        try:
            torch.device(value)
        except (RuntimeError, TypeError, ValueError):
            return False
        return True

    def describe(self) -> str:
        return "a device such as 'cpu', 'cuda' or 'cuda:1'"


@dataclass(frozen=True)
class URLScheme(Constraint):
    """A URL with one of ``schemes`` and a host (``http://127.0.0.1:8000/v1``)."""

    schemes: tuple = ("http", "https")

    def ok(self, value) -> bool:
        from urllib.parse import urlparse

        u = urlparse(str(value))
        return u.scheme in self.schemes and bool(u.netloc)

    def describe(self) -> str:
        return " or ".join(f"an {s}:// URL" for s in self.schemes)


@dataclass(frozen=True)
class Reads(Constraint):
    """The option names something read from disk or a hub: ``"file"`` a weights or settings file (a local path,
    or a hub file ``hf://ORG/NAME/FILE``), ``"model"`` what ``from_pretrained`` loads (a local directory, or a hub
    id ``org/name``). Any string fits; ``flowrl train --smoke`` checks that a local one is there (the real run
    reads it), so no part's option is taken for a path by its name or suffix. ``names``: values the part
    resolves itself (a built-in set's name), not looked for on disk."""

    kind: str = "file"
    names: tuple = ()

    def ok(self, value) -> bool:
        return True

    def describe(self) -> str:
        return "a path or hf://ORG/NAME/FILE" if self.kind == "file" else "a local directory or a hub id"


def _reads_constraints(option: Option) -> list:
    found = [c for c in option.constraints if isinstance(c, Reads)]
    tp = option.type
    for a in typing.get_args(tp) if typing.get_origin(tp) in _UNIONS else ():
        found += [c for c in _split_annotated(a)[1] if isinstance(c, Reads)]
    return found


def reads(option: Option) -> Optional[str]:
    """The :class:`Reads` kind an option declares (on itself or on a member of its Optional / Union), or None."""
    found = _reads_constraints(option)
    return found[0].kind if found else None


def reads_names(option: Option) -> tuple:
    """The built-in names (:class:`Reads` ``names``) an option that reads from disk also takes."""
    return tuple(n for c in _reads_constraints(option) for n in c.names)


PositiveInt = typing.Annotated[int, AtLeast(1)]
NonNegativeInt = typing.Annotated[int, AtLeast(0)]
NonNegativeFloat = typing.Annotated[float, AtLeast(0)]
PositiveFloat = typing.Annotated[float, AtLeast(0, strict=True)]
Fraction = typing.Annotated[float, Between(0, 1)]
Guidance = typing.Annotated[float, AtLeast(1.0)]  # a classifier-free guidance scale: 1.0 = none
Device = typing.Annotated[str, DeviceName()]
WeightsFile = typing.Annotated[str, Reads("file")]  # a local file or hf://ORG/NAME/FILE
ModelSource = typing.Annotated[str, Reads("model")]  # a local directory or a hub id
URL = typing.Annotated[str, URLScheme()]


# ---------------------------------------------------------------------------------------- declarations
@dataclass(frozen=True)
class Option:
    """One declared option: its name, its type (an annotation: ``int``, ``Optional[float]``, ``list[str]``,
    ``Literal[...]``; ``Any`` when undeclared), its default (``REQUIRED`` when it has none) and the
    constraints on its value."""

    name: str
    type: Any = Any
    default: Any = _NO_DEFAULT
    constraints: tuple = ()

    @property
    def required(self) -> bool:
        return self.default is _NO_DEFAULT

    def describe(self) -> str:
        """What a valid value is, in words: ``an integer >= 1``, ``one of 'high', 'low'``, ``a number or null``."""
        return describe_type(typing.Annotated[(self.type, *self.constraints)] if self.constraints else self.type)


REQUIRED = _NO_DEFAULT


def _split_annotated(tp) -> tuple[Any, tuple]:
    if typing.get_origin(tp) is typing.Annotated:
        base, *extra = typing.get_args(tp)
        return base, tuple(e for e in extra if isinstance(e, Constraint))
    return tp, ()


def _hints(obj) -> dict:
    """Resolved annotations (``Annotated`` kept) of a function or class; {} where they cannot be resolved
    (each option is then untyped, ``Any``)."""
    try:
        return typing.get_type_hints(obj, include_extras=True)
    except Exception:  # a forward reference the module does not define at run time
        return {}


def declared(obj, skip: Sequence[str] = ()) -> tuple[dict[str, Option], bool]:
    """``({name: Option}, open)`` of a dataclass's init fields (private ones left out) or a callable's
    keyword parameters, less ``skip``; ``open`` is True when a callable takes ``**kwargs`` (keys beyond the
    declared ones are then not refused here)."""
    out: dict[str, Option] = {}
    if dataclasses.is_dataclass(obj) and isinstance(obj, type):
        hints = _hints(obj)
        for f in dataclasses.fields(obj):
            if not f.init or f.name.startswith("_") or f.name in skip:
                continue
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else _NO_DEFAULT)
            tp, cons = _split_annotated(hints.get(f.name, Any))
            out[f.name] = Option(f.name, tp, default, cons)
        return out, False
    fn = obj.__init__ if isinstance(obj, type) else obj
    hints = _hints(fn)
    is_open = False
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind is p.VAR_KEYWORD:
            is_open = True
            continue
        if p.kind is p.VAR_POSITIONAL or name in ("self", "cls") or name in skip:
            continue
        tp, cons = _split_annotated(hints.get(name, Any))
        out[name] = Option(name, tp, p.default, cons)
    return out, is_open


# ---------------------------------------------------------------------------------------- type checks
_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null",
          dict: "a mapping", list: "a list"}


def _describe_constraints(text: str, constraints: tuple) -> str:
    for c in constraints:
        text += f" {c.describe()}" if isinstance(c, (AtLeast, Between)) else f" ({c.describe()})"
        text += f" ({c.why})" if c.why else ""
    return text


_UNIONS = (Union, types.UnionType)  # Optional[int], int | None
_SEQUENCES = (list, tuple, Sequence, collections.abc.Sequence)
_MAPPINGS = (dict, Mapping, collections.abc.Mapping)


def describe_type(tp) -> str:
    """An annotation in words, as a user writes YAML: ``Optional[Annotated[int, AtLeast(1)]]`` -> ``an integer
    >= 1 or null``."""
    tp, cons = _split_annotated(tp)
    if cons:
        if tp is str and len(cons) == 1 and isinstance(cons[0], (OneOf, DeviceName, URLScheme, Reads)):
            # a name among several: "one of 'a', 'b'"; "a device such as ..."
            return cons[0].describe() + (f" ({cons[0].why})" if cons[0].why else "")
        return _describe_constraints(describe_type(tp), cons)
    if tp is Any:
        return "any value"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _UNIONS:  # only what a recipe can write (a torch.dtype member is for Python callers)
        return " or ".join(dict.fromkeys(describe_type(a) for a in args if not _python_only(a)))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in _SEQUENCES or tp in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:  # fixed length: tuple[int, int]
            if len(set(args)) == 1:
                return f"a list of {len(args)}, each {describe_type(args[0])}"
            return f"a list of {len(args)} ({', '.join(describe_type(a) for a in args)})"
        if not args:
            return "a list"
        item = describe_type(args[0])
        return f"a list, each item {item}"
    if origin in _MAPPINGS or tp is dict:
        return f"a mapping, each value {describe_type(args[1])}" if len(args) == 2 else "a mapping"
    if tp in _NAMES:
        return _NAMES[tp]
    if tp is os.PathLike:
        return "a path"
    return f"a {getattr(tp, '__name__', str(tp))}"


def _python_only(tp) -> bool:
    """A class no recipe value can be (``torch.dtype``, ``torch.device``): accepted from Python callers."""
    return isinstance(tp, type) and tp not in _NAMES and tp is not os.PathLike and typing.get_origin(tp) is None \
        and tp not in (list, tuple, dict)


def fits(value, tp) -> bool:
    """Whether a YAML value fits the annotation ``tp``, its constraints included at every level
    (``Optional[Annotated[int, AtLeast(1)]]``, ``list[Literal[...]]``); a bool is not a number."""
    tp, cons = _split_annotated(tp)
    if not _type_fits(value, tp):
        return False
    return value is None or isinstance(value, bool) or all(c.ok(value) for c in cons)


def _type_fits(value, tp) -> bool:
    if tp is Any:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in _UNIONS:
        return any(fits(value, a) for a in args)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str or tp is os.PathLike:
        return isinstance(value, str)
    if origin in _SEQUENCES or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(fits(v, a) for v, a in zip(value, args))
        return not args or all(fits(v, args[0]) for v in value)
    if origin in _MAPPINGS or tp is dict:
        if not isinstance(value, dict):
            return False
        return len(args) != 2 or all(fits(k, args[0]) and fits(v, args[1]) for k, v in value.items())
    return isinstance(tp, type) and isinstance(value, tp)


def check_value(where: str, option: Option, value) -> None:
    """A ``ValueError`` unless ``value`` fits ``option`` (type, then constraints): ``WHERE must be WHAT, got V``."""
    annotation = typing.Annotated[(option.type, *option.constraints)] if option.constraints else option.type
    if not fits(value, annotation):
        raise ValueError(f"{where} must be {option.describe()}, got {value!r}")


def check_options(where: str, owner: str, options: Mapping[str, Option], given: Mapping, *, open: bool = False,
                  elsewhere: Optional[Mapping[str, str]] = None) -> None:
    """Hold ``given`` (a recipe's mapping) against the declared ``options`` of ``owner`` (e.g. ``the 'sd3'
    model``), reported under ``where`` (``model.options``): an unknown key (unless ``open``) names the closest
    valid one and lists them all; ``elsewhere`` maps keys set in another place to that place (``guidance_scale``
    -> ``model.guidance_scale``); each value is checked by :func:`check_value`. One ``ValueError`` line."""
    # a dotted setting (model.options.KEY), a flag's item (--options KEY), or the bare key for Python callers
    label = (lambda key: f"{where} {key}" if where.startswith("-") else f"{where}.{key}") if where else str  # noqa: E731
    if not isinstance(given, Mapping):
        raise ValueError(f"{where or 'options'} must be a mapping of {owner}'s options, got {given!r}")
    for key, value in given.items():
        if elsewhere and key in elsewhere:
            raise ValueError(f"{label(key)}: set {elsewhere[key]} instead ({owner} takes it from there)")
        if key not in options:
            if open:
                continue
            valid = sorted(options)
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" Did you mean {label(close[0])}?" if close else ""
            raise ValueError(f"{label(key)}: not an option of {owner}.{hint} Valid: {', '.join(valid) or '(none)'}")
        check_value(label(key), options[key], value)


def options_table(options: Mapping[str, Option]) -> list[tuple[str, str, str]]:
    """``(name, what is valid, default)`` rows of a declaration, for help texts and docs."""
    rows = []
    for name, o in sorted(options.items()):
        default = "(required)" if o.required else repr(o.default)
        rows.append((name, o.describe(), default))
    return rows


def check_fields(obj, where: str = "") -> None:
    """Each init field of the dataclass instance ``obj`` held against its declaration (its annotated type and
    range): a ``ValueError`` naming the first that does not fit. A dataclass calls it first in its
    ``__post_init__``, so a Python caller gets the checks a config gets when it loads."""
    options, _ = declared(type(obj))
    for name, option in options.items():
        check_value(f"{where}.{name}" if where else name, option, getattr(obj, name))
