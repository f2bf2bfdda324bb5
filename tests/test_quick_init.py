"""`quick_init` (domain/quick_init.py): the `__init__` it writes makes the
instance dataclasses' own makes, for every class given one and for every
shape of field it takes, and refuses the classes it cannot write for."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pickle
import pkgutil
from collections.abc import Callable
from dataclasses import InitVar, dataclass, field
from typing import Any

import pytest

import intentledger
from intentledger.domain.quick_init import dataclass_init_of, quick_classes, quick_init

# The classes a worker makes for every payment (docs/benchmarks.md, "Frozen
# records made at a third of the cost"): each must keep its quick `__init__`.
HOT = {
    "intentledger.domain.evidence": ["AttemptFacts", "Facts", "SubmitAnswer", "Effect"],
    "intentledger.domain.transport": ["Classification", "ProviderAnswer"],
    "intentledger.domain.merchant_events": ["OperationView"],
    "intentledger.domain.dispatch_plan": ["AttemptPlan"],
    "intentledger.domain.retry_after": ["RetryAfter"],
    "intentledger.store.ledger": ["OperationWrite"],
    "intentledger.engine.changes": ["OperationChange"],
    "intentledger.engine.dispatcher": ["Submission"],
    "intentledger.engine.settlement_queue": ["Prepared", "Sent"],
    "intentledger.providers.base": ["ProviderRequest"],
    "intentledger.providers.http": ["ProviderResponse"],
}


def _ours() -> list[type]:
    """Every class of the package given a quick `__init__` (this module's own
    are tested on their own)."""
    for module in pkgutil.walk_packages(intentledger.__path__, "intentledger."):
        importlib.import_module(module.name)
    return [cls for cls in quick_classes() if cls.__module__.startswith("intentledger.")]


def _outcome(init: Callable[..., None], cls: type, *args: Any, **kwargs: Any) -> Any:
    """What `init` makes of a new instance of `cls` with these arguments: its
    fields in the order they were set, or the error it raised."""
    instance = object.__new__(cls)
    try:
        init(instance, *args, **kwargs)
    except Exception as exc:
        return ("raised", type(exc), str(exc))
    return list(vars(instance).items())


def _same(cls: type, *args: Any, **kwargs: Any) -> Any:
    ours = _outcome(cls.__init__, cls, *args, **kwargs)  # type: ignore[misc]
    theirs = _outcome(dataclass_init_of(cls), cls, *args, **kwargs)
    if isinstance(ours, list) and isinstance(theirs, list):
        # A factory's value is made anew by each: the same kind, not the same object.
        ours = [(name, _factory_made(cls, name, value)) for name, value in ours]
        theirs = [(name, _factory_made(cls, name, value)) for name, value in theirs]
    assert ours == theirs
    return ours


def _factory_made(cls: type, name: str, value: Any) -> Any:
    factory = cls.__dataclass_fields__[name].default_factory  # type: ignore[attr-defined]
    if factory is not dataclasses.MISSING and value == factory():
        return ("made by", factory)
    return value


def test_the_hot_classes_keep_their_quick_init() -> None:
    quick = {(cls.__module__, cls.__name__) for cls in _ours()}
    for module, names in HOT.items():
        for name in names:
            assert (module, name) in quick, f"{module}.{name} lost its quick __init__"


def test_every_quick_class_takes_the_parameters_dataclasses_gave_it() -> None:
    assert _ours()
    for cls in _ours():
        ours = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
        theirs = inspect.signature(dataclass_init_of(cls)).parameters
        assert list(ours) == list(theirs), cls
        for name, parameter in ours.items():
            original = theirs[name]
            assert parameter.kind == original.kind, (cls, name)
            assert (parameter.default is inspect.Parameter.empty) == (
                original.default is inspect.Parameter.empty
            ), (cls, name)
            declared = cls.__dataclass_fields__.get(name)  # type: ignore[attr-defined]
            if declared is not None and declared.default is not dataclasses.MISSING:
                assert parameter.default is original.default, (cls, name)


def _samples() -> dict[type, dict[str, Any]]:
    """Values a class's `__post_init__` reads and accepts, for the classes whose
    `__post_init__` refuses a value of no type; each value distinct."""
    from intentledger.domain.transport import Classification, ProviderAnswer, Transport, Verdict

    return {
        ProviderAnswer: {
            "transport": Transport.RESPONSE,
            "error_class": "e" * 70,  # cut to its column's width by `__post_init__`
            "status": 402,
            "error_code": "card_declined",
            "provider_reference": "r" * 300,  # cut too
            "retry_after": ("120",),
            "detail": {"body": {"id": "ch_1"}},
            "mapped": Classification(Verdict.FAILED, "declined"),
        },
    }


def test_every_quick_class_makes_what_dataclasses_makes() -> None:
    """Each class with a value of its own for every parameter, with `None` for
    each, with values its `__post_init__` accepts where it refuses values of
    no type, and with each default left out: the same fields, set in the same
    order, or the same error."""
    samples = _samples()
    for cls in _ours():
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # type: ignore[misc]
        own = {p.name: object() for p in parameters}
        if isinstance(_outcome(dataclass_init_of(cls), cls, **own), tuple):
            assert cls in samples, f"{cls.__name__} refuses values of no type: give it samples"
            assert list(samples[cls]) == list(own), cls
        for values in (own, dict.fromkeys(own), samples.get(cls, own)):
            positional = [values[p.name] for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD]
            keyword = {p.name: values[p.name] for p in parameters if p.kind is p.KEYWORD_ONLY}
            _same(cls, *positional, **keyword)
            _same(cls, **values)
            required = {p.name: values[p.name] for p in parameters if p.default is p.empty}
            _same(cls, **required)
        _same(cls)  # every required one missing: the same TypeError
        _same(cls, *own.values(), object())  # one too many
        _same(cls, **own, not_a_field=1)


@quick_init
@dataclass(frozen=True)
class _EveryShape:
    plain: int
    defaulted: str = "d"
    made: list[int] = field(default_factory=list)
    unset: int = field(default=7, init=False)
    unset_made: dict[str, int] = field(default_factory=dict, init=False)
    bare: int = field(init=False)  # set by __post_init__, as dataclasses leaves it
    named: int = field(default=3, kw_only=True)
    needed: int = field(kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "bare", self.plain + self.named + self.unset)


def test_every_shape_of_field() -> None:
    assert _same(_EveryShape, 1, needed=2) == [
        ("plain", 1),
        ("defaulted", "d"),
        ("made", ("made by", list)),
        ("unset_made", ("made by", dict)),
        ("named", 3),
        ("needed", 2),
        ("bare", 11),
    ]
    _same(_EveryShape, 1, "x", [5], named=4, needed=2)
    _same(_EveryShape, 1, 2)  # a keyword-only field given by position
    _same(_EveryShape, needed=2)
    one, two = _EveryShape(1, needed=2), _EveryShape(1, needed=2)
    assert one.unset == 7 and "unset" not in vars(one)
    assert one.made is not two.made and one.unset_made is not two.unset_made
    given = [9]
    assert _EveryShape(1, made=given, needed=2).made is given


def test_an_instance_is_still_frozen_and_behaves_as_a_dataclass() -> None:
    made = _EveryShape(1, needed=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.plain = 2  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        del made.plain  # type: ignore[misc]
    assert dataclasses.replace(made, plain=5).bare == 15
    assert pickle.loads(pickle.dumps(made)) == made
    assert hash(made.plain) == hash(1) and made == _EveryShape(1, needed=2)
    assert _EveryShape.__init__.__qualname__ == "_EveryShape.__init__"
    # Shown alike: annotations, defaults, and a factory's default as "<factory>".
    assert str(inspect.signature(_EveryShape.__init__)) == str(
        inspect.signature(dataclass_init_of(_EveryShape))
    )


def test_what_it_cannot_write_for_is_refused() -> None:
    class Plain:
        pass

    @dataclass
    class Mutable:
        value: int

    @dataclass(frozen=True, slots=True)
    class Slotted:
        value: int

    @dataclass(frozen=True)
    class WithInitVar:
        value: int
        seed: InitVar[int]

        def __post_init__(self, seed: int) -> None:
            pass

    @dataclass(frozen=True, init=False)
    class NoInit:
        value: int

    @dataclass(frozen=True)
    class Clashing:
        kept: int

    @dataclass(frozen=True)
    class Prefixed:
        value: int = 1
        default_value: int = 2

    @dataclass(frozen=True)
    class OwnInit:
        value: int

        def __init__(self, value: int) -> None:
            object.__setattr__(self, "value", value * 2)

    class Guarded:
        @property
        def value(self) -> int:
            return 1

        @value.setter
        def value(self, value: int) -> None:
            raise AttributeError("guarded")

    @dataclass(frozen=True)
    class OverGuard(Guarded):
        value: int  # type: ignore[assignment]

    for cls in (
        Plain,
        Mutable,
        Slotted,
        WithInitVar,
        NoInit,
        Clashing,
        Prefixed,
        OwnInit,
        OverGuard,
        _EveryShape,  # given one already
    ):
        with pytest.raises(TypeError):
            quick_init(cls)
