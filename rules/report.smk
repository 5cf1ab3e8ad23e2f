# Reports: parameter accounting, then the aggregate stage - the paper's tables, the paper diff, the figures,
# reports/{experiment}/README.md and the self-contained reports/{experiment}/report.html - rebuilt from
# whatever results exist (gaps shown, never zeros). Which tables and figures: stem.report.registry.
import re  # noqa: E402
from functools import partial  # noqa: E402

from stem.report import registry as report_registry  # noqa: E402
from stem.report import workflow as RW  # noqa: E402
from stem.report.tables import experiment_label  # noqa: E402

REPORT_TABLES = list(report_registry.tables())
REPORT_FIGURES = report_registry.figures()

# Eval JSONs of this experiment: rules/eval.smk defines eval_outputs() (none without it).
eval_results = lambda: globals().get("eval_outputs", list)()  # noqa: E731
report_outputs = partial(RW.report_outputs, EXP)  # used by `rule all` in the Snakefile


report: "../stem/report/captions/workflow.rst"


rule params:
    output:
        csv=L.params_file("{experiment}", "csv"),
        md=L.params_file("{experiment}", "md"),
    params:
        cfg=lambda w: as_json(C.config_part(EXPERIMENT, ("experiment", "archs", "variant_overrides"))),
    log:
        L.experiment_log("{experiment}", "params"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.params --spec {params.cfg:q} --csv {output.csv} --md {output.md} 2> {log}"


rule report_tables:
    input:
        summaries=lambda w: train_outputs(),
        evals=lambda w: eval_results(),
        other=lambda w: RW.table_inputs(EXPERIMENT),  # what a table reads besides (Table 3: checkpoint accounting)
    output:
        **{
            name: report(
                L.table_file("{experiment}", name, "csv"),
                caption="../stem/report/captions/table.rst",
                category="Tables",
                labels={"table": name},
            )
            for name in REPORT_TABLES
        },
        md=[L.table_file("{experiment}", name, ext) for name in REPORT_TABLES for ext in ("md", "tex")],
        long=L.reproduced("{experiment}"),
    params:
        spec=lambda w: as_json(config),
        label=lambda w: experiment_label(w.experiment),
        out=lambda w: L.tables_dir(w.experiment),
    log:
        L.experiment_log("{experiment}", "report_tables"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.report_tables --spec {params.spec:q} --out-dir {params.out} 2> {log}"


rule report_diff:
    input:
        reproduced=L.reproduced("{experiment}"),
        # the accepted-disagreements file (config report.accepted; a path in the repository), when there is one
        accepted=lambda w: [str(L.REPO / a) for a in [(EXPERIMENT.report or {}).get("accepted")] if a],
    output:
        md=report(
            L.diff_file("{experiment}", "diff.md"),
            caption="../stem/report/captions/diff.rst",
            category="Paper diff",
        ),
        cells=L.diff_file("{experiment}", "cells.csv"),
        directions=L.diff_file("{experiment}", "directions.csv"),
        consistency=L.diff_file("{experiment}", "paper_consistency.csv"),
        summary=L.diff_file("{experiment}", "summary.json"),
    params:
        spec=lambda w: as_json(config),
        label=lambda w: experiment_label(w.experiment),
        out=lambda w: L.diff_dir(w.experiment),
    log:
        L.experiment_log("{experiment}", "report_diff"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.report_diff --spec {params.spec:q} --reproduced {input.reproduced} "
        "--out-dir {params.out} "
        "2> {log}"


rule report_figure:
    input:
        unpack(lambda w: RW.figure_inputs(EXPERIMENT, eval_results(), w.figure)),
    output:
        png=report(
            L.figure_file("{experiment}", "{figure}", "png"),
            caption="../stem/report/captions/figure.rst",
            category="Figures",
            labels={"figure": "{figure}"},
        ),
        pdf=L.figure_file("{experiment}", "{figure}", "pdf"),
    wildcard_constraints:
        figure="|".join(map(re.escape, REPORT_FIGURES)),
    params:
        spec=lambda w: as_json(config),
        caption=lambda w: REPORT_FIGURES[w.figure].caption,
        files=lambda w: as_json(RW.figure_inputs(EXPERIMENT, eval_results(), w.figure)),
    log:
        L.experiment_log("{experiment}", "report_figure_{figure}"),
    conda:
        ENV
    shell:
        "MPLBACKEND=Agg python -m workflow_scripts.report_figure --spec {params.spec:q} --name {wildcards.figure} "
        "--reproduced {input.tables} --files {params.files:q} --png {output.png} --pdf {output.pdf} 2> {log}"


rule report_readme:
    input:
        tables=L.reproduced("{experiment}"),
        diff=L.diff_file("{experiment}", "summary.json"),
        params=L.params_file("{experiment}", "md"),
        everything=lambda w: RW.report_files(w.experiment),  # all of it: a missing file is rebuilt, then this
    output:
        report(
            L.report_readme("{experiment}"),
            caption="../stem/report/captions/readme.rst",
            category="Report",
        ),
    params:
        spec=lambda w: as_json(config),
        label=lambda w: experiment_label(w.experiment),
        figures=lambda w: " ".join(report_registry.figures(w.experiment)),
        out=lambda w: L.report_dir(w.experiment),
    log:
        L.experiment_log("{experiment}", "report_readme"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.report_readme --spec {params.spec:q} --report-dir {params.out} "
        "--figures {params.figures} --out {output} 2> {log}"


rule report_html:
    input:
        tables=L.reproduced("{experiment}"),
        diff=L.diff_file("{experiment}", "summary.json"),
        params=L.params_file("{experiment}", "md"),  # linked from the page
        everything=lambda w: RW.report_files(w.experiment),
    output:
        L.report_html("{experiment}"),
    params:
        spec=lambda w: as_json(config),
        figures=lambda w: " ".join(report_registry.figures(w.experiment)),
        out=lambda w: L.report_dir(w.experiment),
    log:
        L.experiment_log("{experiment}", "report_html"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.report_readme --html --spec {params.spec:q} --report-dir {params.out} "
        "--figures {params.figures} --out {output} 2> {log}"
