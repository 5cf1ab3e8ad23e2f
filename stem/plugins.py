"""The one plugin list: the modules whose import registers entries in the registries of ``stem.registry``.

``BUILTIN`` names the project's own modules per registry; a registry imports its own on its first lookup (so
an FFN lookup in a training job does not import the report's pandas and matplotlib). An experiment config's
``plugins: [module, ...]`` names a user's own modules (importable from the repository root or PYTHONPATH),
imported whole by ``load``: by the config's parse (stem.config.experiment.parse, which the Snakefile runs
first), and by every job, whose spec carries the config's ``plugins`` (workflow_scripts/_entry.spec_of). A
plugin module registers with ``stem.registry`` (``FFN_KINDS.add("name", "module:Class")`` keeps torch out
of the DAG). This module imports nothing of the project (its imports are by name, at run time).
"""
from __future__ import annotations

import importlib

BUILTIN: dict[str, tuple[str, ...]] = {
    "ffn kind": ("stem.models.registry",),
    "ffn facts": ("stem.models.registry",),
    "optimizer group": ("stem.models.registry",),
    "suite kind": ("stem.eval.spec",),
    "report table": ("stem.report.tables", "stem.report.figures", "stem.report.analyses",
                     "stem.report.mechanism", "stem.report.sweep_figures", "stem.report.provenance",
                     "stem.report.truncation", "stem.report.real", "stem.report.knowledge"),
    "analysis": ("stem.analysis.workflow",),
    "generator": ("stem.data.synth", "stem.data.bios"),
}
BUILTIN["report figure"] = BUILTIN["report table"]

_done: set[str] = set()


def load_builtin(what: str):
    """Import the built-in modules of one registry, in the list's order (the registration order: no built-in
    module looks an entry up while it is imported), once."""
    if what in _done:
        return
    for module in BUILTIN.get(what, ()):
        importlib.import_module(module)
    _done.add(what)


def load(modules=(), origin: str = "plugins"):
    """Import a config's plugin modules (each once: Python caches modules); a module that cannot be imported
    is one line naming it. The built-in modules are imported by the registries themselves."""
    for module in modules or ():
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"{origin}: plugin module {module!r} cannot be imported ({e}); expected a module "
                              "importable from the repository root or PYTHONPATH") from None


def spec_key(exp) -> dict:
    """What a job spec carries of the config's plugins (``exp``: the config's typed tree, stem.config.experiment.Experiment,
    read by attribute: this module is below it): ``{"plugins": [...]}``, nothing without any (so the specs of a
    config without plugins are unchanged)."""
    return {"plugins": list(exp.plugins)} if exp.plugins else {}
