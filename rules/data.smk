# Data: synthetic corpora (embedded default) -> tokenizer per scale -> token shards per (scale, source).


rule corpus:
    output:
        "data/{experiment}/corpus/{source}.jsonl",
    params:
        spec=lambda w: as_json(C.corpus_spec(config, w.source)),
    log:
        "logs/{experiment}/corpus/{source}.log",
    conda:
        ENV
    shell:
        "python -m workflow_scripts.corpus --spec {params.spec:q} --out {output} 2> {log}"


rule tokenizer:
    input:
        lambda w: [p for s in config["tokenizer"][w.scale].get("sources", []) for p in C.source_inputs(config, s)],
    output:
        "data/{experiment}/{scale}/tokenizer/tokenizer.json",
    params:
        spec=lambda w: as_json(C.tokenizer_spec(config, w.scale)),
    log:
        "logs/{experiment}/{scale}/tokenizer.log",
    conda:
        ENV
    shell:
        "python -m workflow_scripts.tokenizer --spec {params.spec:q} --out {output} 2> {log}"


rule tokenize:
    input:
        tokenizer="data/{experiment}/{scale}/tokenizer/tokenizer.json",
        documents=lambda w: C.source_inputs(config, w.source),
    output:
        directory("data/{experiment}/{scale}/tokens/{source}"),
    params:
        spec=lambda w: as_json(C.tokenize_spec(config, w.scale, w.source)),
    threads: 2
    log:
        "logs/{experiment}/{scale}/tokenize/{source}.log",
    conda:
        ENV
    shell:
        "python -m workflow_scripts.tokenize_source --spec {params.spec:q} --tokenizer {input.tokenizer}"
        " --out {output} --threads {threads} 2> {log}"
