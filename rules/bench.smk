# Systems benchmarks whose figures go into the report. bench_offload: the offloaded STEM engine
# (stem/bench_offload.py, `python -m stem bench offload`) on the experiment's 350m STEM pretrain checkpoint,
# decoding held-out text (the val split of its own training data): tokens/s, hit rate vs cache rows (figure),
# bytes moved per token, FFN memory freed, parameter bytes per decoded token, uniq(BL). Seconds at tiny scale.
#   snakemake --profile profiles/local reports/tiny/offload/offload.json


# rule all's benchmark targets (a lambda: `snakemake --lint` wants no functions beside rules). Only where the
# experiment runs on the CPU (tiny): the benchmark decodes on the CPU, and at paper scale it would load the
# 350M checkpoint once per configuration (ask for the target explicitly there, with the memory for it).
bench_outputs = lambda: (  # noqa: E731
    expand("reports/{exp}/offload/offload.{ext}", exp=EXP, ext=["json", "md", "png"])
    if config.get("device", "cpu") == "cpu"
    else []
)


rule bench_offload:
    input:
        checkpoint=f"{C.stage_dir('{experiment}', '350m', 'stem', 'pretrain')}/checkpoint",
        tokens=lambda w: [C.tokens_manifest(w.experiment, "350m", src)
                          for src in C.train_spec(config, "350m", "stem", "pretrain")["data"]],
    output:
        json="reports/{experiment}/offload/offload.json",
        md="reports/{experiment}/offload/offload.md",
        figure=report(
            "reports/{experiment}/offload/offload.png",
            caption="../stem/report/captions/figure.rst",
            category="Systems",
            labels={"figure": "offload hit rate"},
        ),
    params:
        spec=lambda w: as_json({"batch": 8, "prompt": 32, "steps": 48, "repeats": 2}),
        caption="Offloaded STEM tables (paper Sec. 3.4): LFU cache hit rate vs cache rows per STEM layer while "
        "decoding held-out text, beside the paper's > 80 %; offload.md holds the throughput, bytes moved, "
        "memory and uniq(BL) figures.",
    threads: 1
    log:
        "logs/{experiment}/bench_offload.log",
    conda:
        ENV
    shell:
        "python -m workflow_scripts.bench_offload --spec {params.spec:q} --checkpoint {input.checkpoint}"
        " --json {output.json} --md {output.md} --figure {output.figure} 2> {log}"
