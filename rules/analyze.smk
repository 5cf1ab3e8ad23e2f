# Analyze stage (stem/analysis): the paper's knowledge and mechanism analyses of trained checkpoints -
# knowledge editing (Sec. 3.3, 5.2; Figs 3, 4, 7), Heaps-law parameter usage (Sec. 3.2.5), angular spread
# (Sec. 5.1; Fig. 6a-c), the knowledge capacity probe. One job per (checkpoint, analysis), so one analysis
# reruns alone:
#   snakemake --profile profiles/local results/tiny/350m/stem/pretrain/analysis/editing.json
# Which checkpoints and analyses: config `analysis:`; their tables and figures are report tables / figures
# (stem.report.analyses registers them with stem.report.registry), built by rules/report.smk.
from stem.analysis import workflow as AW  # noqa: E402

analysis_outputs = lambda: AW.targets(EXPERIMENT)  # noqa: E731


rule analyze:
    input:
        unpack(lambda w: AW.rule_inputs(EXPERIMENT, w.scale, w.variant, w.stage, w.analysis)),
    output:
        L.analysis_json(*L.STAGE, "{analysis}"),
    wildcard_constraints:
        analysis="|".join(AW.ANALYSES),
    params:
        spec=lambda w: as_json(AW.job_spec(EXPERIMENT, w.scale, w.variant, w.stage, w.analysis)),
    threads: 1
    resources:
        gpu=lambda w: 0 if EXPERIMENT.device == "cpu" else 1,
    log:
        L.analysis_log(*L.STAGE, "{analysis}"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.analyze --spec {params.spec:q} --checkpoint {input.checkpoint}"
        " --out {output} --threads {threads} 2> {log}"

