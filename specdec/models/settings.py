"""Process-wide settings with an environment default (cpu_linear, batch_invariant,
cpu_compile): one value per process, forced by the CLI, the experiment runner or
`load_model(...)`, else read from an environment variable, else a default."""

from __future__ import annotations

import os

from specdec.errors import SpecDecError


class ProcessSetting:
    """`resolve(value)`: value, else the forced one, else $env, else the default; checked
    against `choices` (booleans, as Hydra reads yes / no, map to on / off when
    `booleans`). `force(value)` fixes it for the process; None restores the environment."""

    def __init__(
        self, what: str, env: str, choices: tuple[str, ...], default: str, *, booleans=True
    ):
        self.what, self.env, self.choices, self.default = what, env, choices, default
        self.booleans = booleans
        self.forced: str | None = None

    def force(self, value: str | bool | None) -> None:
        self.forced = None if value is None else self.resolve(value)

    def resolve(self, value: str | bool | None = None) -> str:
        if self.booleans and isinstance(value, bool):
            value = "on" if value else "off"
        value = value or self.forced or os.environ.get(self.env) or self.default
        if value not in self.choices:
            raise SpecDecError(
                f"invalid {self.what} {value!r} (choose one of {', '.join(self.choices)})"
            )
        return value
