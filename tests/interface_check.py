"""Whether a test's fake still matches what it stands for: the methods the interface names, each with
the same parameters (names, kinds, which have defaults). A fake that subclasses a Protocol inherits its
`...` bodies, and a fake called positionally accepts any names, so neither would notice a changed seam."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Protocol

SEAM_BASES = (object, Protocol)


def interface_methods(interface: type) -> list[str]:
    """The public methods the interface itself defines (not those of object or typing)."""
    names: set[str] = set()
    for cls in interface.__mro__:
        if cls in SEAM_BASES or cls.__module__ in ("typing", "abc", "builtins"):
            continue
        names |= {n for n, v in vars(cls).items() if not n.startswith("_") and inspect.isfunction(v)}
    return sorted(names)


def _shape(func: Callable[..., object]) -> list[tuple[str, str, bool]]:
    params = list(inspect.signature(func).parameters.values())
    return [(p.name, p.kind.name, p.default is not inspect.Parameter.empty) for p in params]


def _defined_by(fake: type, name: str, interface: type) -> type | None:
    """The class of the fake's MRO that defines `name`, unless it is the interface (or one of its bases)."""
    owner = next((cls for cls in fake.__mro__ if name in vars(cls)), None)
    return None if owner is None or owner in interface.__mro__ else owner


def signature_drift(fake: type, interface: type, names: Iterable[str] | None = None) -> list[str]:
    """How `fake` differs from `interface` on `names` (default: every method the interface defines):
    empty when they agree."""
    drift = []
    for name in names if names is not None else interface_methods(interface):
        if _defined_by(fake, name, interface) is None:
            drift.append(f"{fake.__name__}.{name}: missing (the interface {interface.__name__} has it)")
            continue
        want, got = _shape(getattr(interface, name)), _shape(getattr(fake, name))
        if want != got:
            drift.append(f"{fake.__name__}.{name}{inspect.signature(getattr(fake, name))} differs from "
                         f"{interface.__name__}.{name}{inspect.signature(getattr(interface, name))}")
    return drift
