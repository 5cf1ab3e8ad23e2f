# Reports: the accounting table (more tables, figures and the paper diff come with the aggregate stage).


rule params:
    output:
        csv="reports/{experiment}/params.csv",
        md="reports/{experiment}/params.md",
    params:
        cfg=lambda w: as_json({k: config[k] for k in ("experiment", "archs", "variant_overrides") if k in config}),
    log:
        "logs/{experiment}/params.log",
    conda:
        ENV
    shell:
        "python {SCRIPTS}/params.py --spec {params.cfg:q} --csv {output.csv} --md {output.md} 2> {log}"
