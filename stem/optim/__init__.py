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

from stem.fields import OPTIONAL, FieldError, check, is_number
from stem.options import TableUpdate, values

TABLE_UPDATES = values(TableUpdate)        # optim.table_update


@dataclass(frozen=True)
class OptimSpec:
    """AdamW (``build``); ``groups``: per optimizer group ``lr_mult`` / ``weight_decay`` overrides of the
    registry's defaults (``stem.models.registry.OPTIM_GROUPS``); ``table_update``: how the ``table`` group is
    updated (``stem.optim.adamw``: dense, the paper, or sparse)."""
    betas: tuple[float, float]
    weight_decay: float
    eps: float
    grad_clip: float | None
    groups: dict = field(default_factory=dict)
    table_update: str = field(default="dense", metadata=OPTIONAL)

    def __post_init__(self):
        check(self.table_update in TABLE_UPDATES, "table_update", f"one of {', '.join(TABLE_UPDATES)}",
              self.table_update)
        for name, o in self.groups.items():
            check(isinstance(o, dict) and set(o) <= {"lr_mult", "weight_decay"}
                  and all(is_number(v) for v in o.values()), f"groups.{name}",
                  "a mapping of lr_mult and/or weight_decay numbers", o)

    @classmethod
    def coerce(cls, optim) -> "OptimSpec":
        """An OptimSpec given as itself or as the experiment config's ``optim`` mapping (tools and tests that
        hold the config, not a job spec; a job passes its TrainSpec's ``optim``). The mapping may leave out
        ``grad_clip`` (the training step's, not the optimizer's: None)."""
        if isinstance(optim, cls):
            return optim
        try:
            return cls(**{"grad_clip": None, **optim, "betas": tuple(optim["betas"])})
        except FieldError as e:
            raise ValueError(f"optim.{e.field}: {e}") from None

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
