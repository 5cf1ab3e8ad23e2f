"""The one registration mechanism: every extension point of the project is a ``Registry`` (name -> entry).

    FFN_KINDS       FFN module classes, built as ``cls(cfg, layer)``           (stem.models.registry)
    FFN_FACTS       an FFN kind's torch-free facts (``FFNFacts``)                (stem.models.registry)
    OPTIM_GROUPS    optimizer groups: (LR multiplier, weight decay or None)     (stem.models.registry)
    SUITE_KINDS     eval suite runners (``SuiteKind``)                           (stem.eval.spec)
    REPORT_TABLES   report tables (``PaperTable``)                               (stem.report.registry)
    REPORT_FIGURES  report figures (``Figure``)                                  (stem.report.registry)
    ANALYSES        analyses of a checkpoint (``Analysis``)                      (stem.analysis.workflow)
    GENERATORS      synthetic document generators ``gen(world, seed, **kw)``    (stem.data.synth)

An entry is registered with ``REG.register(name)`` (a decorator) or ``REG.add(name, entry)``; an entry given
as a ``"module:attr"`` string is imported on first use (torch-level classes and functions: the config check
and the DAG see the name without importing torch). The built-in entries and a config's own plugin modules
(``plugins: [module, ...]``) are imported through ``stem.plugins``: a registry imports its built-in modules
on its first lookup, the config check, the Snakefile and every job import the config's plugins.
This module imports nothing of the project but ``stem.plugins`` (itself import-free).
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping

from stem import plugins


class UnknownName(KeyError, ValueError):
    """A name no entry is registered under (a KeyError for ``Mapping.get``, a ValueError for the one-line
    error of the entry points); its text is the one line."""

    def __str__(self):
        return str(self.args[0])


class Registry(Mapping):
    """name -> entry, in registration order (built-in entries first); a read-only mapping plus ``add``,
    ``register`` and ``remove``."""

    def __init__(self, what: str):
        self.what = what            # e.g. "suite kind": the errors' wording and stem.plugins.BUILTIN's key
        self._entries: dict = {}

    def add(self, name: str, entry):
        """Register ``entry`` under ``name``; registering the same entry again is a no-op, another one an error."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.what} {name!r}: expected a non-empty string name")
        if name in self._entries and self._entries[name] != entry:
            old = self._entries[name]
            label = old if isinstance(old, str) else getattr(old, "__qualname__", None)
            raise ValueError(f"{self.what} {name!r}: already registered" + (f" ({label})" if label else ""))
        self._entries[name] = entry
        return entry

    def register(self, name: str, make=None):
        """Decorator: register the decorated object (or ``make(obj)``) under ``name``; returns the object."""
        def deco(obj):
            self.add(name, obj if make is None else make(obj))
            return obj
        return deco

    def registered(self, name: str):
        """The entry registered under ``name`` so far, or None; imports no built-in module (for a module that
        reads, while it is imported, an entry of a module it imports itself: stem.report.figures, a table's title)."""
        return resolve(self._entries[name]) if name in self._entries else None

    def remove(self, name: str):
        """Unregister ``name`` (a test's toy entry); returns its entry."""
        return self._entries.pop(name)

    def _loaded(self) -> dict:
        plugins.load_builtin(self.what)
        return self._entries

    def __getitem__(self, name: str):
        entries = self._loaded()
        if name not in entries:
            raise UnknownName(f"unknown {self.what} {name!r}; expected one of {', '.join(entries)}")
        entry = entries[name] = resolve(entries[name])
        return entry

    def __contains__(self, name) -> bool:
        return name in self._loaded()

    def __iter__(self):
        return iter(list(self._loaded()))

    def __len__(self) -> int:
        return len(self._loaded())

    def names(self) -> list[str]:
        return list(self._loaded())

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._entries)})"


def resolve(target):
    """``target`` itself, or the object a ``"module:attr"`` string names (imported now)."""
    if isinstance(target, str):
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)
    return target


FFN_KINDS = Registry("ffn kind")
FFN_FACTS = Registry("ffn facts")
OPTIM_GROUPS = Registry("optimizer group")
SUITE_KINDS = Registry("suite kind")
REPORT_TABLES = Registry("report table")
REPORT_FIGURES = Registry("report figure")
ANALYSES = Registry("analysis")
GENERATORS = Registry("generator")
