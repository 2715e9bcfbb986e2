"""Name -> class registries for the pluggable parts of the engine (drafters, acceptance
rules): a class decorator registers, `lookup` and `check_options` give user errors."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Generic, TypeVar

from specdec.errors import SpecDecError

T = TypeVar("T", bound=type)


class Registry(dict[str, T], Generic[T]):
    """`what` names the kind in messages; `error` is the exception class raised."""

    def __init__(self, what: str, error: type[SpecDecError] = SpecDecError):
        super().__init__()
        self.what, self.error = what, error

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: `cls.name = name` and cls buildable by that name."""

        def register(cls: T) -> T:
            if name in self and self[name] is not cls:
                raise ValueError(f"{self.what} {name!r} is already registered")
            cls.name = name
            self[name] = cls
            return cls

        return register

    def lookup(self, name: str) -> T:
        if name not in self:
            known = ", ".join(sorted(self))
            raise self.error(f"unknown {self.what} {name!r}; choose one of {known}")
        return self[name]

    def check_options(self, cls: T, options: dict, hidden: tuple[str, ...] = ()) -> None:
        """Every key of `options` is a parameter of cls's constructor (`hidden` ones are
        filled in by the caller and left out of the message)."""
        takes = [n for n in inspect.signature(cls).parameters if n not in hidden]
        unknown = sorted(set(options) - set(takes))
        if unknown:
            raise self.error(
                f"{self.what} {cls.name!r} has no parameter(s) {', '.join(unknown)}; "
                f"it takes: {', '.join(takes) or 'none'}"
            )
