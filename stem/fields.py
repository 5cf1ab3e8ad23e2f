"""Typed dataclasses from mappings: the one parser of the experiment config (``stem.config.experiment``) and the job
specs (``stem.specs``; ``stem.optim.OptimSpec`` below them), and the checks a dataclass runs on its own fields
(``__post_init__``). Torch-free and importing nothing of stem: the lowest layer.

``node(cls, mapping, key, parser)`` builds dataclass ``cls``: unknown and missing keys, each value converted to its
field's type (``convert``: unions, nested dataclasses, ``StrEnum`` option lists, ``dict[K, V]``, tuples, scalars;
numbers kept as written, so an integer stays one where a number is expected and a JSON spec round-trips unchanged),
the field's range (``metadata=expect(...)``, or ``Annotated[type, expect(...)]`` inside a container), then the
class's own ``__post_init__`` (a ``FieldError`` names its field). Every error is one line naming the full key
(``a.b.c``); ``Parser`` says which exception and how it is worded (the config's and the specs' differ).
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from enum import StrEnum

OPTIONAL = {"omit_default": True}       # field metadata: left out of a spec's to_dict() at its default


class FieldError(Exception):
    """A dataclass's own check of one of its fields; ``node`` names the full key (``optim.x``)."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field = field


def check(ok: bool, field: str, expected: str, value):
    if not ok:
        raise FieldError(field, f"expected {expected}, got {value!r}")


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def expect(ok, expected: str, **meta) -> dict:
    """A range: ``ok(value)`` must hold for a set value (``expected`` says what is expected); a field's metadata,
    or the second argument of ``Annotated``."""
    return {"ok": ok, "expected": expected, **meta}


@dataclass(frozen=True)
class Parser:
    """How ``node`` / ``convert`` report a bad value: the exception, the wording of a value that does not fit
    (``{key}``, ``{value}``: its repr, ``{expected}``) and of an unknown key (``{key}``, ``{names}``: the known ones);
    ``own``: dataclasses parsed by their own ``from_dict`` (a TypeError/ValueError of it names the key)."""
    error: type
    wrong: str
    unknown: str
    own: tuple = ()

    def fail(self, key: str, value, expected: str) -> Exception:
        return self.error(self.wrong.format(key=key, value=repr(value), expected=expected))


def describe(tp) -> str:
    """What a value of type ``tp`` is, in the words of an error line."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is type(None):
        return "null"
    if origin is typing.Annotated:
        return args[1]["expected"]
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        return f"one of {', '.join(m.value for m in tp)}"
    if origin is tuple:
        return f"a list of {len(args)} numbers" if args[-1] is not Ellipsis else f"a list ({describe(args[0])} each)"
    if origin is dict or tp is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def convert(tp, value, key: str, parser: Parser):
    """``value`` as type ``tp`` (numbers kept as written); ``parser``'s one-line error naming ``key`` otherwise."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:   # a type with its range: either failing is the range's one line
        try:
            out = convert(args[0], value, key, parser)
        except parser.error:
            raise parser.fail(key, value, args[1]["expected"]) from None
        if not args[1]["ok"](out):
            raise parser.fail(key, value, args[1]["expected"])
        return out
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        nodes = [a for a in args if dataclasses.is_dataclass(a)]
        if nodes and isinstance(value, dict):   # a mapping where a node may stand: that node's own errors
            return convert(nodes[0], value, key, parser)
        for a in args:
            if a is not type(None):
                try:
                    return convert(a, value, key, parser)
                except parser.error:
                    pass
        raise parser.fail(key, value, describe(tp))
    if tp in parser.own:
        if not isinstance(value, dict):
            raise parser.fail(key, value, "a mapping")
        try:
            return tp.from_dict(value)
        except (TypeError, ValueError) as e:
            raise parser.error(f"key '{key}': {e}") from None
    if dataclasses.is_dataclass(tp):
        return node(tp, value, key, parser)
    if isinstance(tp, type) and issubclass(tp, StrEnum):
        if value not in [m.value for m in tp]:
            raise parser.fail(key, value, describe(tp))
        return tp(value)
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise parser.fail(key, value, "a mapping")
        if tp is dict:
            return value
        return {convert(args[0], k, f"{key}.{k}", parser): convert(args[1], v, f"{key}.{k}", parser)
                for k, v in value.items()}
    if origin is tuple:
        n = None if args[-1] is Ellipsis else len(args)
        if not isinstance(value, (list, tuple)) or (n is not None and len(value) != n):
            raise parser.fail(key, value, describe(tp))
        return tuple(convert(args[0] if n is None else args[i], v, f"{key}.{i}", parser) for i, v in enumerate(value))
    ok = {bool: isinstance(value, bool), int: isinstance(value, int) and not isinstance(value, bool),
          float: is_number(value), str: isinstance(value, str), typing.Any: True}.get(tp)
    if not ok:
        raise parser.fail(key, value, describe(tp))
    return value


def key_of(f: dataclasses.Field, cls=None) -> str:
    """The key a mapping writes for field ``f`` (of class ``cls``): its name, or ``metadata["key"]`` where the key
    is not a Python name (a variant's ``insert.from``: field ``from_``), or ``cls.KEYS[name]`` where a class writes
    an inherited field under its own key (``cluster.strategy``: the job's ``parallel``, stem.specs.Layout)."""
    return getattr(cls, "KEYS", {}).get(f.name) or f.metadata.get("key", f.name)


def node(cls, d, key: str, parser: Parser):
    """Build dataclass ``cls`` from mapping ``d`` found at ``key`` (``""``: the top): unknown and missing keys,
    types, ranges (``expect`` metadata), then its own checks (``__post_init__``; a ``FieldError`` names its key).
    ``cls.EXTRA`` names a field that keeps the keys the class does not type; the built object's ``_written`` are
    the keys ``d`` writes."""
    if not isinstance(d, dict):
        raise parser.fail(key or "<top level>", d, "a mapping")
    prefix = f"{key}." if key else ""
    fields = {key_of(f, cls): f for f in dataclasses.fields(cls) if f.init}   # by the key a mapping writes
    extra = getattr(cls, "EXTRA", None)
    unknown = sorted(k for k in d if k not in fields or k == extra)
    if unknown and not extra:
        raise parser.error(parser.unknown.format(key=prefix + unknown[0], names=", ".join(fields)))
    hints = typing.get_type_hints(cls, include_extras=True)
    kw = {extra: {k: d[k] for k in d if k in unknown}} if extra else {}
    for name, f in fields.items():
        if name == extra:
            continue
        if name not in d:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise parser.error(f"key '{prefix}{name}' missing (expected {describe(hints[f.name])})")
            continue
        value = convert(hints[f.name], d[name], prefix + name, parser)
        if "ok" in f.metadata and value is not None and not f.metadata["ok"](value):
            raise parser.fail(prefix + name, d[name], f.metadata["expected"])
        kw[f.name] = value
    try:
        out = cls(**kw)
    except FieldError as e:
        sep = " " if str(e).startswith("missing") else ": "
        raise parser.error(f"key '{prefix}{e.field}'{sep}{e}") from None
    object.__setattr__(out, "_written", frozenset(kw))   # the keys the mapping writes (a null one too)
    return out


def override(obj, over: dict, key: str, parser: Parser):
    """Node ``obj`` (a dataclass, found at ``key``) with the keys of mapping ``over`` set over its own
    (``dataclasses.replace``): each value converted to its field's type and checked against its range as ``node``
    does; a nested node or a mapping of nodes is overridden key by key (a variant's ``optim: {groups: {table:
    {lr_mult: ...}}}`` keeps the group's other settings); then the node's own checks. The result's ``_written``
    are ``obj``'s and ``over``'s keys."""
    if not isinstance(over, dict):
        raise parser.fail(key or "<top level>", over, "a mapping")
    prefix = f"{key}." if key else ""
    fields = {key_of(f, type(obj)): f for f in dataclasses.fields(obj) if f.init}
    hints = typing.get_type_hints(type(obj), include_extras=True)
    kw = {}
    for name, value in over.items():
        if name not in fields:
            raise parser.error(parser.unknown.format(key=prefix + name, names=", ".join(fields)))
        f = fields[name]
        kw[f.name] = _override_value(hints[f.name], getattr(obj, f.name), value, prefix + name, parser)
        if "ok" in f.metadata and kw[f.name] is not None and not f.metadata["ok"](kw[f.name]):
            raise parser.fail(prefix + name, value, f.metadata["expected"])
    try:
        out = dataclasses.replace(obj, **kw)
    except FieldError as e:
        raise parser.error(f"key '{prefix}{e.field}': {e}") from None
    object.__setattr__(out, "_written", frozenset(getattr(obj, "_written", ())) | frozenset(kw))
    return out


def _override_value(tp, old, value, key: str, parser: Parser):
    """One overridden field: a node under a mapping is overridden, a mapping of nodes key by key, else converted."""
    if dataclasses.is_dataclass(old) and isinstance(value, dict):
        return override(old, value, key, parser)
    args = typing.get_args(tp)
    if isinstance(old, dict) and isinstance(value, dict) and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        new = convert(tp, {k: v for k, v in value.items() if k not in old}, key, parser)
        kept = {k: override(n, value[k], f"{key}.{k}", parser) if k in value else n for k, n in old.items()}
        return {**kept, **new}
    return convert(tp, value, key, parser)
