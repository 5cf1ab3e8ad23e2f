"""Knowledge and mechanism analyses of trained checkpoints (STEM paper Sec. 3.2.5, 3.3, 5; Figs 3, 4, 6, 7).

One module per analysis, each ``run(ckpt_dir, spec) -> dict`` (the JSON written to
``results/{experiment}/{scale}/{variant}/{stage}/analysis/{name}.json``):

- ``editing``: knowledge editing by replacing token-indexed vectors (STEM tables; the token embedding as the
  dense model's comparable intervention), the four schemes of Fig. 4, edit success / Fig. 7 / collateral;
- ``heaps``: unique token ids vs context length, the Heaps fit and the activated STEM parameters (Sec. 3.2.5);
- ``spread``: pairwise cosine-similarity distributions of address vectors (Fig. 6a-c);
- ``capacity``: the fraction of the synthetic world's facts a model recalls (per relation, frequency bucket);
- the DSE paper's mechanism analyses (its Sec. 6, App. G), for models with a DSE memory against their baseline:
  ``logitlens`` (KL of each layer's early exit to the final distribution, Fig. 3a), ``cka`` (minibatch linear
  CKA between baseline and DSE layers, the soft alignment a_j, Fig. 3b-c), ``dse_disabled`` (accuracy with the
  DSE gate forced to 0 / 1 through the eval path, Figs 9-10).

The report layer turns the per-checkpoint JSONs into tables and figures (stem.report.analyses, and
stem.report.mechanism for the DSE analyses) and gives directions a confidence (stem.report.verdict).
"""
