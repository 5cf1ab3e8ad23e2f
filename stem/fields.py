"""Checks a spec dataclass runs on its own fields (``__post_init__``), shared by ``stem.specs`` and the spec
dataclasses below it (``stem.optim.OptimSpec``). Torch-free and importing nothing of stem: the lowest layer."""
from __future__ import annotations

OPTIONAL = {"omit_default": True}       # field metadata: left out of a spec's to_dict() at its default


class FieldError(Exception):
    """A dataclass's own check of one of its fields; ``stem.specs`` names the full key (``optim.x``)."""

    def __init__(self, field: str, problem: str):
        super().__init__(problem)
        self.field = field


def check(ok: bool, field: str, expected: str, value):
    if not ok:
        raise FieldError(field, f"expected {expected}, got {value!r}")


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)
