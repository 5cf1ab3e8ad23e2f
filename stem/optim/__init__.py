"""The optimizer: ``OptimSpec`` (the job spec's ``optim`` section) and ``OptimSpec.build(model, lr)``, the
AdamW it describes (``stem.optim.adamw``: parameter groups, the row-sparse table update).

Layering: this package sits between ``stem.models`` and ``stem.specs``. ``stem.specs`` re-exports
``OptimSpec`` and is imported by the workflow's DAG build (through ``stem.config``), which must not import
torch: this module is torch-free, and the torch-level ``stem.optim.adamw`` is imported inside the functions
that build or configure something (the only place it is needed). ``adamw`` imports nothing from here (it
takes an OptimSpec as an argument), so the two modules do not import each other.

``build_optimizer`` and ``configure_table_update`` are the same for tools and tests that hold the experiment
config's ``optim`` mapping rather than a job spec.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from stem.fields import OPTIONAL, Parser, expect, node
from stem.options import TableUpdate
from stem.registry import OPTIM_GROUPS

AT_LEAST_0 = expect(lambda v: v >= 0, "a number >= 0")


class _Registered:
    """What ``optim.groups`` expects of a key, worded when an error is: a group registered so far (``OPTIM_GROUPS``:
    the built-in ones, ``stem.models.registry``, and a config's plugins')."""

    def __str__(self):
        return f"a registered optimizer group (one of {', '.join(OPTIM_GROUPS)})"


REGISTERED_GROUP = expect(lambda k: k in OPTIM_GROUPS, _Registered())
OPTIM = Parser(ValueError, wrong="key '{key}': expected {expected}, got {value}",
               unknown="key '{key}': unknown (expected one of {names})")


@dataclass(frozen=True)
class Group:
    """An optimizer group's settings over the registry's defaults (``stem.models.registry.OPTIM_GROUPS``): the
    config's ``optim.groups.<group>`` and a stage's ``table_group``; a key not set is left out of the job spec."""
    lr_mult: float | None = field(default=None, metadata={**OPTIONAL, **AT_LEAST_0})
    weight_decay: float | None = field(default=None, metadata={**OPTIONAL, **AT_LEAST_0})


@dataclass(frozen=True)
class OptimSpec:
    """AdamW (``build``): the experiment config's ``optim`` section (``stem.config.experiment.Optim`` is this class) and
    a training job's spec's, one declaration; a variant's ``optim:`` keys are set over it
    (``stem.fields.override``). ``groups``: per optimizer group (any registered in ``OPTIM_GROUPS``, a plugin's
    too) ``lr_mult`` / ``weight_decay`` overrides of the registry's defaults; ``table_update``: how the ``table`` group is updated (``stem.optim.adamw``: dense, the
    paper, or sparse: the batch's rows only)."""
    betas: tuple[float, float]
    weight_decay: float = field(metadata=AT_LEAST_0)
    eps: float = field(metadata=expect(lambda v: v > 0, "a number > 0"))
    grad_clip: float = field(metadata=AT_LEAST_0)   # the training step's gradient-norm clip (0: none)
    groups: dict[Annotated[str, REGISTERED_GROUP], Group] = field(default_factory=dict)
    table_update: TableUpdate = field(default=TableUpdate.DENSE, metadata=OPTIONAL)

    @classmethod
    def coerce(cls, optim) -> "OptimSpec":
        """An OptimSpec given as itself or as its mapping (the config's ``optim`` or a job spec's JSON; tools and
        tests that hold a mapping). The mapping may leave out ``grad_clip`` (the training step's, not the
        optimizer's: 0)."""
        if isinstance(optim, cls):
            return optim
        try:
            return node(cls, {"grad_clip": 0, **optim}, "optim", OPTIM)
        except ValueError as e:
            raise ValueError(str(e).replace("key '", "", 1).replace("'", "", 1)) from None

    @property
    def sparse_tables(self) -> bool:
        return self.table_update == TableUpdate.SPARSE

    def row_sparse_tables(self, model) -> tuple[str, ...]:
        """Names of the modules whose tables this update trains row-sparse (none for ``dense``); checks that
        each supports it. Changes nothing: ``stem.optim.adamw.use_row_sparse`` switches them."""
        from stem.optim import adamw   # torch-level (see the module docstring)
        return adamw.row_sparse_tables(model, self)

    def build(self, model, lr: float, fused: bool = False):
        """The AdamW (``RowSparseAdamW`` for ``table_update: sparse``) over the model's parameter groups."""
        from stem.optim import adamw   # torch-level (see the module docstring)
        return adamw.build_optimizer(model, self, lr, fused=fused)


def build_optimizer(model, optim, lr: float, fused: bool = False):
    """``OptimSpec.build`` of an OptimSpec or the config's ``optim`` mapping."""
    return OptimSpec.coerce(optim).build(model, lr, fused=fused)


def configure_table_update(model, optim) -> tuple[str, ...]:
    """Switch the model's tables to row-sparse gradients as ``optim`` (an OptimSpec or the config's mapping)
    says; returns their module names (none for ``dense``). A job does it in two steps instead: the names go
    into its ParallelPlan (``stem.train.plan``), then ``adamw.use_row_sparse``."""
    from stem.optim import adamw   # torch-level (see the module docstring)
    names = OptimSpec.coerce(optim).row_sparse_tables(model)
    adamw.use_row_sparse(model, names)
    return names
