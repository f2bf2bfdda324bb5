"""A frozen dataclass's `__init__`, written to cost a third of dataclasses' own.

dataclasses writes a frozen class's `__init__` to set each field through
`object.__setattr__` (the class's own `__setattr__` refuses): about 120 ns a
field in CPython 3.11, where a class that is not frozen takes 25. A worker's
pure work makes about 135 such fields a payment (the evidence's facts and
effect, the answer, the request, the change and its views); written here,
that work fell from about 55 µs a payment to 45, 3 % of a worker's CPU
(docs/benchmarks.md, "Frozen records made at a third of the cost").

`quick_init` writes the same `__init__` — the same parameters in the same
order, the same defaults, default factories, keyword-only fields and fields
left out of it, and `__post_init__` called last — that stores each field in
the instance's `__dict__` instead, as attrs does for its frozen classes. The
instances hold the same fields, set in the same order, and still refuse
every assignment afterwards; `tests/test_quick_init.py` compares each class
given one with dataclasses' own `__init__`. One thing differs: CPython 3.11
keeps a new instance's attributes inline until its `__dict__` is asked for,
and this asks at once, so each instance holds a dict of its own, one more
object for the cyclic collector (which a worker collects rarely:
eventloop.py's `YOUNG_GENERATION_THRESHOLD`).

Refused (a `TypeError` when the class is made): a class that is not a frozen
dataclass whose `__init__` dataclasses wrote, or was given one already; one
with slots (no `__dict__`); one with an `InitVar` (a parameter that is no
field); one whose base classes hold a descriptor under a field's name (a
write to `__dict__` would pass it by); and a field named like a name the
written `__init__` uses.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["dataclass_init_of", "quick_classes", "quick_init"]

_Class = TypeVar("_Class", bound=type)

# Each class given a quick `__init__`, and the one dataclasses wrote for it
# (for the tests' comparison).
_DATACLASS_INIT: dict[type, Callable[..., None]] = {}


class _FactoryDefault:
    """Stands for "not given" where a field's default is made by a factory,
    shown as dataclasses shows its own."""

    def __repr__(self) -> str:
        return "<factory>"


_FACTORY_DEFAULT = _FactoryDefault()
# Names the written `__init__` binds besides the fields.
_OWN_NAMES = frozenset({"self", "kept", "MISSING"})


def quick_init(cls: _Class) -> _Class:
    """Give `cls`, a frozen dataclass, an `__init__` that stores its fields
    into the instance's `__dict__` (module doc)."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or not params.init:
        raise TypeError(f"{cls.__name__}: quick_init is for a frozen dataclass writing __init__")
    if "__slots__" in cls.__dict__:
        raise TypeError(f"{cls.__name__}: a class with slots has no __dict__ to write")
    original: Callable[..., None] = cls.__init__  # type: ignore[misc]
    if cls in _DATACLASS_INIT or original.__code__.co_filename != "<string>":
        raise TypeError(f"{cls.__name__}: its __init__ is not the one dataclasses wrote")
    fields = dataclasses.fields(cls)
    passed_by = [
        f.name
        for f in fields
        for base in cls.__mro__[1:]
        if hasattr(type(base.__dict__.get(f.name)), "__set__")
    ]
    if passed_by:
        raise TypeError(
            f"{cls.__name__}: a base class's descriptors {passed_by} would be passed by"
        )
    expected = [f.name for f in fields if f.init]
    given = list(inspect.signature(original).parameters)[1:]
    if sorted(given) != sorted(expected):
        raise TypeError(f"{cls.__name__}: an InitVar is no field, and is not written here")
    clash = _OWN_NAMES.intersection(f.name for f in fields) | {
        f.name for f in fields if f.name.startswith("default_") or f.name.startswith("factory_")
    }
    if clash:
        raise TypeError(f"{cls.__name__}: fields named {sorted(clash)} clash with the writer's")
    namespace: dict[str, Any] = {"MISSING": _FACTORY_DEFAULT}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = ["    kept = self.__dict__"]
    for field in fields:
        name = field.name
        has_factory = field.default_factory is not dataclasses.MISSING
        has_default = field.default is not dataclasses.MISSING
        if has_factory:
            namespace[f"factory_{name}"] = field.default_factory
        if has_default and field.init:
            namespace[f"default_{name}"] = field.default
        if field.init:
            parameter = name
            if has_factory:
                parameter += "=MISSING"
            elif has_default:
                parameter += f"=default_{name}"
            (keyword if field.kw_only else positional).append(parameter)
            if has_factory:
                body.append(
                    f"    kept[{name!r}] = factory_{name}() if {name} is MISSING else {name}"
                )
            else:
                body.append(f"    kept[{name!r}] = {name}")
        elif has_factory:
            body.append(f"    kept[{name!r}] = factory_{name}()")
        # A field out of `__init__` with a plain default is not set, as
        # dataclasses leaves it: its class attribute is the default.
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()")
    signature = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    source = f"def __init__({signature}):\n" + "\n".join(body) + "\n"
    exec(source, namespace)  # code made of the class's own field names
    written = namespace["__init__"]
    written.__qualname__ = f"{cls.__qualname__}.__init__"
    written.__module__ = cls.__module__
    written.__doc__ = original.__doc__
    written.__annotations__ = dict(original.__annotations__)
    _DATACLASS_INIT[cls] = original
    cls.__init__ = written  # type: ignore[misc]
    return cls


def dataclass_init_of(cls: type) -> Callable[..., None]:
    """The `__init__` dataclasses wrote for a class `quick_init` was given."""
    return _DATACLASS_INIT[cls]


def quick_classes() -> list[type]:
    """Every class given a quick `__init__` so far (the modules imported)."""
    return list(_DATACLASS_INIT)
