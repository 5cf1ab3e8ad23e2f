# Evaluation: every checkpoint gets the suites config `eval.stages` maps its stage to (Tables 3-6,
# Figure 1b). One job per (checkpoint, suite); any stage can be evaluated on any configured suite:
#   snakemake --profile profiles/local results/tiny/1b/stem/pretrain/eval/mmlu.json
# The embedded default runs the real lm-eval tasks offline on fixtures generated from the synthetic
# world (rule eval_fixtures); config/paper.yaml has no fixtures and uses the real datasets.
from stem.eval import spec as EV  # noqa: E402  (torch-free)


# rule all's eval targets (a lambda: `snakemake --lint` wants no functions beside rules)
eval_outputs = lambda: EV.eval_targets(EXPERIMENT)  # noqa: E731


rule eval_fixtures:
    input:
        unpack(lambda w: EV.fixture_inputs(EXPERIMENT)),
    output:
        directory(L.fixtures_dir("{experiment}")),
    params:
        spec=lambda w: as_json(EV.fixture_spec(EXPERIMENT)),
    log:
        L.fixtures_log("{experiment}"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.eval_fixtures --spec {params.spec:q} --out {output} 2> {log}"


rule eval:
    input:
        unpack(lambda w: EV.rule_inputs(EXPERIMENT, w.experiment, w.scale, w.variant, w.stage, w.suite)),
    output:
        result=L.eval_json(*L.STAGE, "{suite}"),
        raw=L.eval_raw(*L.STAGE, "{suite}"),
    wildcard_constraints:
        suite="[a-z0-9_]+",
    params:
        spec=lambda w: as_json(EV.job_spec(EXPERIMENT, w.experiment, w.scale, w.variant, w.stage, w.suite)),
    threads: 1
    resources:
        gpu=lambda w: 0 if EXPERIMENT.device == "cpu" else 1,
    log:
        L.eval_log(*L.STAGE, "{suite}"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.eval_suite --spec {params.spec:q} --checkpoint {input.checkpoint}"
        " --out {output.result} --raw {output.raw} --threads {threads} 2> {log}"
