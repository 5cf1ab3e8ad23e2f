# Systems benchmarks whose figures go into the report. bench_offload: the offloaded STEM engine
# (stem/bench/offload.py, `python -m stem bench offload`) on the experiment's 350m STEM pretrain checkpoint,
# decoding held-out text (the val split of its own training data): tokens/s, hit rate vs cache rows (figure),
# bytes moved per token, FFN memory freed, parameter bytes per decoded token, uniq(BL). Seconds at tiny scale;
# on the CPU at paper scale too (minutes: the 350M model decodes once per cache configuration). The report's
# figure offload_hit_rate reads its JSON, so the aggregate stage asks for it.
#   snakemake --profile profiles/local reports/tiny/offload/offload.json
# bench_offload_variant: the same benchmark on another variant's 350m pretrain checkpoint (a STEM variant, or
# dse: its hashed DSE tables offloaded, per-table caches); asked for by path, not by the report:
#   snakemake --profile profiles/local reports/tiny/offload/dse/offload.json


rule bench_offload:
    input:
        checkpoint=L.checkpoint("{experiment}", "350m", "stem", "pretrain"),
        tokens=lambda w: [L.tokens_manifest(w.experiment, "350m", src)
                          for src in C.train_spec(EXPERIMENT, "350m", "stem", "pretrain")["data"]],
    output:
        json=L.offload_file("{experiment}", "json"),
        md=L.offload_file("{experiment}", "md"),
    params:
        spec=lambda w: as_json({"batch": 8, "prompt": 32, "steps": 48, "repeats": 2}),
    threads: 1
    log:
        L.experiment_log("{experiment}", "bench_offload"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.bench_offload --spec {params.spec:q} --checkpoint {input.checkpoint}"
        " --json {output.json} --md {output.md} 2> {log}"


rule bench_offload_variant:
    input:
        checkpoint=L.checkpoint("{experiment}", "350m", "{variant}", "pretrain"),
        tokens=lambda w: [L.tokens_manifest(w.experiment, "350m", src)
                          for src in C.train_spec(EXPERIMENT, "350m", w.variant, "pretrain")["data"]],
    output:
        json=L.offload_file("{experiment}", "json", "{variant}"),
        md=L.offload_file("{experiment}", "md", "{variant}"),
    params:
        spec=lambda w: as_json({"batch": 8, "prompt": 32, "steps": 48, "repeats": 2}),
    threads: 1
    log:
        L.experiment_log("{experiment}", "bench_offload_{variant}"),
    conda:
        ENV
    shell:
        "python -m workflow_scripts.bench_offload --spec {params.spec:q} --checkpoint {input.checkpoint}"
        " --json {output.json} --md {output.md} 2> {log}"
