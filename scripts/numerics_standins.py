"""How much do the tiny results move with the CPU's numerics? (issue 39, docs/confidence.md "Reproducible")

Trains one tiny job (the experiment's spec, ``--steps`` steps) several times, each in a fresh process under a
stand-in for another machine, and compares each with the pipeline's own setting (one intra-op thread,
deterministic algorithms on, this CPU's kernels): the final training loss, the largest weight difference and
the held-out loss the loss direction bootstraps (stem.analysis.heldout, the config's windows). The stand-ins:

  again          the same setting again (must be bit-identical)
  threads=2      two intra-op threads (what a job would get if its cluster cpus were 2)
  nondeterministic  torch.use_deterministic_algorithms left off
  aten=default   ATEN_CPU_CAPABILITY=default: PyTorch's own kernels without AVX2/AVX-512 (another CPU's ISA)
  mkl=compatible MKL_CBWR=COMPATIBLE: MKL's matrix products on its most portable code path (another CPU's BLAS)

    python scripts/numerics_standins.py --data DIR_WITH_data/ [--scale 350m --variant stem --steps 20]
    python scripts/numerics_standins.py --data SMOKE_CHECKOUT --chain 1b/stem_insert/extend --standin aten=default

``--chain scale/variant/stage``: instead, every training job the variant and the baseline need up to ``stage``
(the config's steps), under one stand-in, then their held-out loss direction (the report's paired bootstrap),
printed beside the same direction from ``--data``'s own results and each job's largest weight difference from
them (the reference: the machine and setting that wrote ``--data``'s results).

``--data``: a folder whose ``data/{experiment}/`` holds a finished tokenize stage (e.g. a make smoke's checkout);
read only. Prints one JSON line per stand-in. Needs a few CPU-minutes (one training job per stand-in).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.numpy import load_file

from stem import config as C
from stem.config import experiment
from stem import layout as L

STANDINS = {"reference": ({}, 1, True), "again": ({}, 1, True), "threads=2": ({}, 2, True),
            "nondeterministic": ({}, 1, False), "aten=default": ({"ATEN_CPU_CAPABILITY": "default"}, 1, True),
            "mkl=compatible": ({"MKL_CBWR": "COMPATIBLE"}, 1, True)}

CHILD = """
import json, sys, torch
spec, threads, deterministic, heldout = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", json.loads(sys.argv[4])
if not deterministic:   # the training loop switches deterministic algorithms on for the CPU: keep them off
    torch.use_deterministic_algorithms = lambda *a, **k: None
from stem.train.loop import train
from stem.analysis import heldout as H
s = train(spec, threads=threads)
h = H.run(spec["out_dir"] + "/checkpoint", heldout)
print(json.dumps({"last_step_loss": s["last_step_loss"], "heldout": h["window_loss"],
                  "capability": torch.backends.cpu.get_cpu_capability()}))
"""


def job(args, out: Path) -> tuple[dict, dict]:
    """The tiny spec of ``args.scale``/``args.variant`` (``args.steps`` steps, written under ``out``) and the
    held-out spec of the loss direction."""
    exp = experiment.load(C.REPO / "config" / f"{args.experiment}.yaml")
    spec = C.train_spec(exp, args.scale, args.variant, "pretrain")
    spec["train"]["steps"] = args.steps
    spec["out_dir"] = str(out)
    held = exp.analyses()["heldout"]
    held = held if isinstance(held, dict) else {"source": held.source, "windows": held.windows, "seq_len": held.seq_len}
    return spec, {**held, "manifest": L.tokens_manifest(exp.experiment, args.scale, held["source"])}


def run(args, name: str, work: Path) -> dict:
    env_extra, threads, det = STANDINS[name]
    spec, held = job(args, work / name)
    env = {**os.environ, **env_extra, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec), str(threads), "1" if det else "0",
                        json.dumps(held)], cwd=args.data, env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"stand-in {name}: {r.stderr.strip().splitlines()[-1]}")
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "weights": str(work / name / "checkpoint")}


def compare(ref: dict, other: dict) -> dict:
    a, b = (load_file(f"{x['weights']}/model.safetensors") for x in (ref, other))
    dw = max(float(abs(a[k].astype("float64") - b[k]).max()) for k in a)
    hl = [y - x for x, y in zip(ref["heldout"], other["heldout"])]
    return {"bit_identical": dw == 0.0, "max_abs_weight_diff": dw,
            "last_step_loss_diff": other["last_step_loss"] - ref["last_step_loss"],
            "heldout_mean_diff": sum(hl) / len(hl), "heldout_max_abs_window_diff": max(abs(x) for x in hl),
            "capability": other["capability"]}


def chain_jobs(exp, scale: str, variant: str, stage: str) -> list[tuple[str, str]]:
    """(variant, stage) of every training job the direction needs, in dependency order."""
    stages = list(exp.matrix[scale].stages)
    upto = stages[:stages.index(stage) + 1]
    base = C.baseline_variant(exp)
    return [(v, st) for v in (base, variant) for st in upto if st in exp.matrix[scale].stages
            and not (v != base and st in stages[:stages.index(getattr(C.variant_spec(exp, v).insert, "stage",
                                                                          stages[0]))])]


def chain(args, name: str):
    """Train ``args.chain``'s jobs under stand-in ``name`` in a scratch folder beside ``--data``'s data (read
    only), then compare its held-out loss direction and weights with ``--data``'s results."""
    from stem.report import verdict as V
    scale, variant, stage = args.chain.split("/")
    exp = experiment.load(C.REPO / "config" / f"{args.experiment}.yaml")
    env_extra, threads, det = STANDINS[name]
    env = {**os.environ, **env_extra, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    held = exp.analyses()["heldout"]
    held = {"source": held.source, "windows": held.windows, "seq_len": held.seq_len,
            "manifest": L.tokens_manifest(exp.experiment, scale, held.source)}
    with tempfile.TemporaryDirectory(prefix="numerics_chain_") as tmp:
        (Path(tmp) / "data").symlink_to(Path(args.data).resolve() / "data")
        losses, out = {}, {"standin": name, "chain": args.chain, "jobs": {}}
        for v, st in chain_jobs(exp, scale, variant, stage):
            spec = C.train_spec(exp, scale, v, st)
            r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec), str(threads), "1" if det else "0",
                                json.dumps(held)], cwd=tmp, env=env, capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"{v}/{st}: {r.stderr.strip().splitlines()[-1]}")
            losses[v] = json.loads(r.stdout.strip().splitlines()[-1])["heldout"]
            mine = load_file(f"{tmp}/{spec['out_dir']}/checkpoint/model.safetensors")
            ref = load_file(f"{args.data}/{spec['out_dir']}/checkpoint/model.safetensors")
            out["jobs"][f"{v}/{st}"] = max(float(abs(mine[k].astype("float64") - ref[k]).max()) for k in ref)
    base = C.baseline_variant(exp)
    refs = {v: json.loads((Path(args.data) / L.analysis_json(exp.experiment, scale, v, stage, "heldout"))
                          .read_text())["window_loss"] for v in (base, variant)}
    for key, w in (("standin", losses), ("reference", refs)):
        ci = V.paired_bootstrap(w[base], w[variant])
        out[key] = {"delta": ci["delta"], "interval": [ci["lo"], ci["hi"]], "p": V.p_value(ci)}
    print(json.dumps(out), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="folder holding data/{experiment}/ (a finished tokenize stage)")
    p.add_argument("--experiment", default="tiny")
    p.add_argument("--scale", default="350m")
    p.add_argument("--variant", default="stem")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--only", action="append", help="stand-ins to run (default: all)")
    p.add_argument("--chain", help="scale/variant/stage: the held-out loss direction's whole chain of jobs")
    p.add_argument("--standin", default="aten=default", choices=list(STANDINS), help="with --chain: the stand-in")
    args = p.parse_args(argv)
    if args.chain:
        return chain(args, args.standin)
    with tempfile.TemporaryDirectory(prefix="numerics_") as tmp:
        ref = run(args, "reference", Path(tmp))
        for name in args.only or [n for n in STANDINS if n != "reference"]:
            print(json.dumps({"standin": name, **compare(ref, run(args, name, Path(tmp)))}), flush=True)


if __name__ == "__main__":
    main()
