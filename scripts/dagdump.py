"""Dump every job of the workflow's DAG to a text file: rule, wildcards, inputs, outputs, params (the spec JSON
included), resources and threads, one block per job, sorted, the repository's path replaced by ``<repo>``.

    python scripts/dagdump.py OUT [--configfile config/paper.yaml ...] [--target all --target sweep_rho ...]

Two dumps of one experiment compare with ``cmp``: byte-identical means the refactoring between them changed
no job (issue 38's "behaviour unchanged"). The DAG is built with every job forced (``forceall``), so results
already on disk do not hide a job. No ``--configfile``: the Snakefile's default (config/tiny.yaml).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from snakemake.api import SnakemakeApi
from snakemake.settings.types import (ConfigSettings, DAGSettings, OutputSettings, ResourceSettings,
                                      StorageSettings)

REPO = Path(__file__).resolve().parents[1]


def _norm(value) -> str:
    return str(value).replace(str(REPO), "<repo>")


def _named(items) -> list[str]:
    """A Snakemake Namedlist (input, output, params) as ``name=value`` lines (positional ones by index)."""
    names = {i: n for n, (i, _end) in items._names.items()} if hasattr(items, "_names") else {}
    return [f"{names.get(i, i)}={_norm(v)}" for i, v in enumerate(items)]


def _job(job) -> str:
    res = {k: v for k, v in job.resources.items() if k not in ("_cores", "_nodes", "tmpdir")}
    lines = [f"rule {job.rule.name}",
             *(f"  wildcard {k}={_norm(v)}" for k, v in sorted(job.wildcards_dict.items())),
             *(f"  input {s}" for s in _named(job.input)),
             *(f"  output {s}" for s in _named(job.output)),
             *(f"  param {s}" for s in _named(job.params)),
             *(f"  resource {k}={_norm(v)}" for k, v in sorted(res.items())),
             f"  threads {job.threads}"]
    return "\n".join(lines) + "\n"


def dump(configfiles: list[str], targets: list[str]) -> str:
    blocks = sorted(_job(j) for j in jobs(configfiles, targets))
    return "".join(blocks) + f"# {len(blocks)} jobs\n"


def jobs(configfiles: list[str], targets: list[str]) -> list:
    """Every job of the DAG (Snakemake's Job objects), built in this process from the repository's Snakefile."""
    cwd = os.getcwd()
    try:
        return _jobs(configfiles, targets)
    finally:
        os.chdir(cwd)


def _jobs(configfiles: list[str], targets: list[str]) -> list:
    os.chdir(REPO)
    with SnakemakeApi(OutputSettings()) as api:
        wf_api = api.workflow(resource_settings=ResourceSettings(cores=2),
                              config_settings=ConfigSettings(configfiles=[Path(c).resolve() for c in configfiles],
                                                             replace_workflow_config=bool(configfiles)),
                              storage_settings=StorageSettings(), snakefile=REPO / "Snakefile", workdir=REPO)
        dag_api = wf_api.dag(dag_settings=DAGSettings(targets=set(targets), forceall=True))
        wf = dag_api.workflow_api._workflow
        wf._prepare_dag(forceall=True, ignore_incomplete=True, lock_warn_only=True, nolock=True)
        wf._build_dag()
        return list(wf.dag.jobs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--configfile", action="append", default=[])
    ap.add_argument("--target", action="append", default=[])
    a = ap.parse_args(argv)
    text = dump(a.configfile, a.target or ["all"])
    Path(a.out).write_text(text)
    print(f"{a.out}: {text.count(chr(10) + 'rule ') + text.startswith('rule ')} jobs", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
