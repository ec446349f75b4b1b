"""Settings with a fixed set of values: the values are written once, as a `Literal` type, and checked from it."""

from __future__ import annotations

import typing


def allowed_values(choices: object) -> tuple:
    """The values a `Literal[...]` type allows (nested Literals flattened, in order), or a tuple of them as given."""
    return choices if isinstance(choices, tuple) else typing.get_args(choices)


def check_choice(name: str, value: object, choices: object) -> None:
    """Raise ValueError naming the field and the allowed values unless value is one of choices (a Literal type, or
    the tuple typing.get_args gives of one)."""
    allowed = allowed_values(choices)
    if value not in allowed:
        raise ValueError(f"{name} = {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}")
