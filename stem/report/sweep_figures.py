"""The DSE sweeps' figures in the report (stem.report.registry; one of its built-in modules, stem.plugins.BUILTIN, after
the paper's and the analyze stage's figures): ``sweep_rho`` and ``sweep_slots``, drawn from
``reports/{experiment}/sweeps/{kind}.json`` when ``sweeps.in_all`` is true (so the report asks for the sweeps),
else a placeholder saying how to run them."""
from __future__ import annotations

import json
from pathlib import Path

from stem import layout as L
from stem.report import figures as F
from stem.report import registry
from stem.report.sweeps import figure


def _report_inputs(kind):
    def inputs(exp, evals):
        if exp.sweeps is None or not exp.sweeps.in_all or getattr(exp.sweeps, kind) is None:
            return {}
        return {"sweep": L.sweep_file(exp.experiment, kind, "json")}
    return inputs


def _report_draw(kind):
    def draw(exp, res, ours, files):
        if "sweep" in files:
            return figure(json.loads(Path(files["sweep"]).read_text()))
        fig, ax = F.pyplot().subplots(figsize=(6.5, 4.5))
        F.mark_missing(ax, f"the {kind} sweep is not part of this run (sweeps.in_all is false or sweeps.{kind} is "
                     f"missing); run it with `snakemake sweep_{kind}`")
        F.set_title(fig, "DSE paper Fig. 2 " + ("left: loss vs rho" if kind == "rho" else "right: loss vs DSE slots"), exp)
        return fig
    return draw


registry.report_figure(
    "sweep_rho", "Sparsity allocation (DSE paper Sec. 3.1, Fig. 2 left): validation loss vs rho, the fraction of "
    "the inactive parameters in routed MoE experts (1 = pure MoE), the rest in DSE table rows, at the rho = 1 "
    "model's P_tot and P_act (deviations in sweeps/rho.md); lowest loss marked. The paper finds a U-shape with "
    "its optimum near rho = 0.75-0.80.", inputs=_report_inputs("rho"))(_report_draw("rho"))
registry.report_figure(
    "sweep_slots", "Memory scaling (DSE paper Sec. 3.2, Fig. 2 right): validation loss vs the number of DSE "
    "slots at a fixed backbone, with the least-squares fit loss = a + b log10(M) (slope and r^2 in the figure "
    "and sweeps/slots.json). The paper finds it roughly log-linear.", inputs=_report_inputs("slots"))(
    _report_draw("slots"))
