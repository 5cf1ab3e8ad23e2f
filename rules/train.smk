# Training stages. One rule for every stage: the stage's spec (config) says where it starts from
# (init_from) and what it reads (data mixture). Resumable state lives in {stage}/_state (undeclared),
# so a failed, preempted or timed-out job resumes when it is rerun or retried.


rule train:
    input:
        unpack(train_inputs),
    output:
        summary="results/{experiment}/{scale}/{variant}/{stage}/summary.json",
        metrics="results/{experiment}/{scale}/{variant}/{stage}/metrics.jsonl",
        checkpoint=directory("results/{experiment}/{scale}/{variant}/{stage}/checkpoint"),
    params:
        spec=lambda w: as_json(C.train_spec(config, w.scale, w.variant, w.stage)),
    threads: 1
    resources:
        gpu=lambda w: 0 if config["device"] == "cpu" else 1,
    log:
        "logs/{experiment}/{scale}/{variant}/{stage}/train.log",
    conda:
        ENV
    shell:
        "python -m workflow_scripts.train --spec {params.spec:q} --threads {threads} 2> {log}"
