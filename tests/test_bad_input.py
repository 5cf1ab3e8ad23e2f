"""No silent failures, second pass (issue 21): the newer surfaces (memory CLI, MDS, offload, DSE config,
TensorBoard, checkpoint slots, config paths, undefined sources) answer bad input with one line naming the
file/key/value, a non-zero exit, and nothing half-written."""
import copy
import dataclasses
import json
import os
import re
import shutil
import sys

import numpy as np
import pytest
import torch
import yaml

from conftest import make_spec
from stem import config as C
from stem.train.loop import TrainingError, train
from workflow_scripts._entry import run as run_entry


def _one_line(err: str) -> str:
    """The error line of a failed command's stderr: exactly one, the last line, and no traceback (progress lines
    such as 'stem: evaluating on device cpu' may come before it)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and sum(line.startswith("error") for line in lines) == 1 and lines[-1].startswith("error: "), err
    assert "Traceback" not in err, err
    return lines[-1]


def _cli(argv, capsys) -> tuple[int, str]:
    """``python -m stem ...`` in this process: (exit status, its one stderr line)."""
    from stem.__main__ import main
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, _one_line(capsys.readouterr().err)


def _entry(monkeypatch, capsys, module, argv) -> tuple[int, str]:
    """A workflow entry point (workflow_scripts.<module>) in this process, as its rule runs it."""
    import importlib
    main = importlib.import_module(f"workflow_scripts.{module}").main
    monkeypatch.setattr(sys, "argv", [module, *argv])
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_entry(main)
    return e.value.code, _one_line(capsys.readouterr().err)


@pytest.fixture(scope="module")
def stem_ckpt(tiny_data, tmp_path_factory):
    """A finished 2-step STEM pretraining checkpoint of the tiny data (saved job tiny/350m/stem/pretrain)."""
    out = tmp_path_factory.mktemp("bad_input") / "run"
    train(make_spec(tiny_data, out, steps=2, eval_interval=2, checkpoint_interval=2), threads=1)
    return out / "checkpoint"


def _slot(ckpt, root, variant):
    """The checkpoint copied into another variant's slot of the results layout."""
    slot = root / "results" / "tiny" / "350m" / variant / "pretrain" / "checkpoint"
    shutil.copytree(ckpt, slot)
    return slot


# ---- python -m stem memory: a filter matching no job, a world size out of range -------------------------
@pytest.mark.parametrize("argv, message", [
    (["--scale", "7b"], "error: python -m stem memory: argument --scale: scale '7b': expected one of 350m, 1b"),
    (["--gpus", "0"], "error: python -m stem memory: argument --gpus: 0: expected a whole number >= 1 (GPUs: the "
                      "world size)"),
    (["--gpus", "-4"], "error: python -m stem memory: argument --gpus: -4: expected a whole number >= 1 (GPUs: the "
                       "world size)"),
    (["--workers", "two"], "error: python -m stem memory: argument --workers: two: expected a whole number >= 1"),
    (["--variant", "stem_quarter"], "error: --variant stem_quarter: no training job of experiment 'tiny' matches; "
                                    "its matrix trains 350m: dense,"),
    (["--gpus", "3", "--scale", "350m", "--variant", "dense"],   # was a worker's RuntimeError traceback
     "error: --gpus 3: training job 350m/dense/pretrain: batch_size 16 cannot be split into micro-batches of 5 over 3 "
     "ranks"),
])
def test_memory_arguments_out_of_range_are_one_line(capsys, argv, message):
    code, line = _cli(["memory", "--experiment", "tiny", *argv], capsys)
    assert code == 1 and line.startswith(message)


def test_memory_scale_outside_the_matrix_is_one_line(tmp_path, capsys):
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["matrix"] = {"350m": cfg["matrix"]["350m"]}
    path = tmp_path / "only350m.yaml"
    path.write_text(yaml.safe_dump(cfg))
    code, line = _cli(["memory", "--config", str(path), "--scale", "1b", "--cache", str(tmp_path / "c")], capsys)
    assert code == 1 and line.startswith("error: --scale 1b: no training job of experiment 'tiny' matches")
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("argv, message", [
    (["bench", "ffn", "--scale", "7b"], "bench: argument --scale: scale '7b': expected one of 350m, 1b"),  # was KeyError
    (["bench", "offload", "--steps", "0"], "bench: argument --steps: 0: expected a whole number >= 1 (decode steps)"),
    (["train", "--scale", "350m", "--variant", "stem", "--stage", "final"],
     "train: argument --stage: stage 'final': expected one of pretrain, midtrain, extend"),
    (["diff", "--gate-tolerance", "-1"], "diff: argument --gate-tolerance: -1: expected a number >= 0"),
    (["eval", "--checkpoint", "c", "--cache-rows", "-1"], "eval: argument --cache-rows: -1: expected a whole number >= 0"),
    # the surfaces of issues 29 and 31: the communication model, the GPU acceptance run's budget and MFU floor
    (["comms", "--mfu", "40"], "comms: argument --mfu: 40: expected a fraction in (0, 1] (MFU)"),
    (["comms", "--inter-gbs", "0"], "comms: argument --inter-gbs: 0: expected a number >= 1e-09 (GB/s)"),
    (["gpucheck", "--budget", "-5"], "gpucheck: argument --budget: -5: expected a number >= 1 (seconds)"),
    (["gpucheck", "--require-mfu", "2"], "gpucheck: argument --require-mfu: 2: expected a fraction in (0, 1] (dense 1B MFU)"),
])
def test_every_subcommands_arguments_are_typed(capsys, argv, message):
    code, line = _cli(argv, capsys)
    assert code == 1 and line.startswith(f"error: python -m stem {message}")


# ---- a config file that does not exist ---------------------------------------------------------------------
@pytest.mark.parametrize("cmd", [["memory"], ["params"], ["train", "--scale", "350m", "--variant", "stem"],
                                 ["diff"]])
def test_missing_config_file_is_one_line(capsys, cmd):
    code, line = _cli([*cmd, "--config", "nonexistent.yaml"], capsys)
    assert code == 1 and line == (f"error: python -m stem {cmd[0]}: argument --experiment/--config: 'nonexistent.yaml': "
                                  "no such experiment config file; expected tiny, paper, rehearsal, real, knowledge (config/{name}.yaml) "
                                  "or the path of an experiment YAML")


# ---- DSE orders: checked when the config is loaded ----------------------------------------------------------
@pytest.mark.parametrize("orders", [[0, 3], [], [1, 2]])
def test_dse_orders_below_two_empty_or_repeated_are_one_line(tmp_path, capsys, orders):
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["variant_overrides"] = {**cfg.get("variant_overrides", {}), "dse": {"dse": {"orders": orders}}}
    with pytest.raises(C.ConfigError) as e:
        C.experiment.parse(copy.deepcopy(cfg), origin="bad.yaml")
    assert str(e.value) == (
        f"bad.yaml: variant 'dse' (config/variants.yaml + variant_overrides): key 'dse.orders': dse.orders={orders}: "
        "expected a non-empty list of distinct whole N-gram orders >= 2 (the DSE paper's Eq. 2 concatenates "
        "n = 2..N; order 1 is the token alone, which the token embedding already holds)")
    path = tmp_path / "bad.yaml"   # and the command line says so before a job is built
    path.write_text(yaml.safe_dump(cfg))
    code, line = _cli(["train", "--config", str(path), "--scale", "350m", "--variant", "dse"], capsys)
    assert code == 1 and line.startswith(f"error: {path}: variant 'dse' ") and "dse.orders=" in line


def test_dse_heads_and_width_checked_too():
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    for dse, message in [({"heads": 0}, "key 'dse.heads': dse.heads=0: expected a whole number >= 1"),
                         ({"d_mem": 30, "heads": 4}, "key 'dse.d_mem': dse.d_mem=30: must divide evenly over 8"),
                         ({"order": [2]}, "key 'dse.order': unknown; expected placement or one of orders, heads")]:
        bad = {**cfg, "variant_overrides": {"dse": {"dse": dse}}}
        with pytest.raises(C.ConfigError, match=message):
            C.experiment.parse(copy.deepcopy(bad), origin="bad.yaml")


def test_fit_memory_without_a_gpu_memory_limit_is_one_line():
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    bad = {**cfg, "cluster": {**cfg["cluster"], "fit_memory": True}}
    with pytest.raises(C.ConfigError) as e:
        C.experiment.parse(copy.deepcopy(bad), origin="bad.yaml")
    assert str(e.value) == ("bad.yaml: key 'cluster.fit_memory': true fits each training job to cluster.gpu_mem_gib; "
                            "expected cluster.gpu_mem_gib set (GiB per GPU)")


# ---- a suite key its kind does not read (issue 43 item 2): refused, naming the suite, key, kind, accepted keys --
@pytest.mark.parametrize("suite, key, value, kind", [
    ("commonsense", "needle", "original", "lm_eval"),   # a NIAH key on an lm-eval suite: evaluated as if absent before
    ("niah", "num_fewshot", 5, "niah"),
    ("niah", "tasks", ["arc_easy"], "niah"),
])
def test_a_suite_key_its_kind_does_not_read_is_one_line(suite, key, value, kind):
    from stem.registry import SUITE_KINDS
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["eval"]["suites"][suite][key] = value
    with pytest.raises(C.ConfigError) as e:
        C.experiment.parse(cfg, origin="bad.yaml")
    accepted = [f.name for f in __import__("dataclasses").fields(SUITE_KINDS[kind].settings)]
    assert str(e.value) == (f"bad.yaml: key 'eval.suites.{suite}.{key}': not a key of suite kind {kind} (it would be "
                            f"ignored); expected one of {', '.join(accepted)}")
    assert key not in accepted and "kind" in accepted and "truncation" in accepted


@pytest.mark.parametrize("suite, edit, message", [
    ("niah", {"truncation": "left"}, "key 'eval.suites.niah.truncation': 'left'; expected error (NIAH prompts"),
    ("niah", {"samples": 0}, "key 'eval.suites.niah.samples': 0; expected an integer >= 1"),
    ("commonsense", {"tasks": []}, "key 'eval.suites.commonsense.tasks': []; expected at least 1 tasks"),
    ("commonsense", {"truncation": "both"}, "key 'eval.suites.commonsense.truncation': 'both'"),
])
def test_a_suite_kinds_own_ranges_are_one_line(suite, edit, message):
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["eval"]["suites"][suite].update(edit)
    with pytest.raises(C.ConfigError) as e:
        C.experiment.parse(cfg, origin="bad.yaml")
    assert str(e.value).startswith(f"bad.yaml: {message}") and "\n" not in str(e.value)


# ---- a target of an undefined source (what the data rules' input functions call) -----------------------------
def test_undefined_source_in_a_target_is_one_line_naming_the_defined_ones():
    cfg = C.experiment.load(C.REPO / "config" / "tiny.yaml")
    message = "source 'wiki': not defined in the tiny config's sources; expected one of ['bios_n0032', 'code', 'long', 'math', 'web']"
    for fn in (lambda: C.part_names(cfg, "wiki"), lambda: C.source_inputs(cfg, "wiki"),
               lambda: C.corpus_spec(cfg, "wiki"), lambda: C.tokenize_spec(cfg, "350m", "wiki"),
               lambda: C.documents_spec(cfg, "wiki")):
        with pytest.raises(C.ConfigError) as e:
            fn()
        assert str(e.value) == message


# ---- MDS: a corrupt and a truncated shard name the folder, the shard and the row --------------------------------
def _mds_folder(root):
    from stem.data.sources import streaming_format
    fmt = streaming_format()
    columns = {"input_ids": "ndarray:uint32", "indices": "ndarray:uint32"}
    with fmt.MDSWriter(out=str(root), columns=columns, size_limit=1 << 20) as w:
        for r in range(3):
            w.write({"input_ids": np.arange(r, r + 128, dtype=np.uint32), "indices": np.array([[0, 64], [64, 128]], np.uint32)})
    return {"kind": "mds", "paths": [str(root)], "ids_field": "input_ids", "indices_field": "indices", "vocab_size": 512}


@pytest.mark.parametrize("damage, message", [
    # row 0's offsets overwritten (mosaicml-streaming: "IndexError: Relative sample index 0 is not present ...")
    (lambda p: p.write_bytes(p.read_bytes()[:4] + b"\xff" * 8 + p.read_bytes()[12:]),
     r": row 0: cannot decode the MDS sample \(IndexError: "),
    (lambda p: os.truncate(p, p.stat().st_size - 40), r": row 2: cannot decode the MDS sample \("),
])
def test_damaged_mds_shard_is_one_line_naming_the_shard_and_row(tmp_path, damage, message):
    from stem.data.sources import iter_documents
    spec = _mds_folder(tmp_path / "mds")
    assert len(list(iter_documents(spec))) == 6
    shard = tmp_path / "mds" / "shard.00000.mds"
    damage(shard)
    with pytest.raises(ValueError, match=f"^{shard}{message}") as e:
        list(iter_documents(spec))
    assert "\n" not in str(e.value)


# ---- other foreign files: a truncated .jsonl.gz, parquet file and column chunk, a tokenizer.json of another kind ----
def test_truncated_or_corrupt_documents_and_tokenizer_are_one_line_naming_the_file(tmp_path):
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    from stem.data.sources import iter_documents
    from stem.data.tokenizer import load_tokenizer
    rows = [{"text": f"document {i} " * 20} for i in range(2000)]
    gz, pf, chunk = tmp_path / "a.jsonl.gz", tmp_path / "a.parquet", tmp_path / "b.parquet"
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.truncate(gz, gz.stat().st_size // 2)
    pq.write_table(pa.Table.from_pylist(rows), pf)
    pq.write_table(pa.Table.from_pylist(rows), chunk)
    os.truncate(pf, pf.stat().st_size - 100)
    data = bytearray(chunk.read_bytes())
    data[100:400] = bytes(300)
    chunk.write_bytes(bytes(data))
    for path, fmt, message in [
            (gz, "jsonl", f"{gz}: cannot read as jsonl (EOFError: Compressed file ended before the end-of-stream marker "
                          "was reached); expected a whole, readable file"),
            (pf, "parquet", f"{pf}: cannot read as parquet (ArrowInvalid: Parquet magic bytes not found in footer."),
            (chunk, "parquet", f"{chunk}: row group 0: cannot read as parquet (")]:
        with pytest.raises(ValueError) as e:
            list(iter_documents({"kind": "files", "paths": [str(path)], "format": fmt}))
        assert str(e.value).startswith(message) and "\n" not in str(e.value)
    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(ValueError, match=f"^tokenizer file {tok}: cannot parse \\(.*\\); expected a Hugging Face "
                                         "tokenizers tokenizer.json$"):
        load_tokenizer(tok)


# ---- checkpoint slots: a job reading a checkpoint refuses one saved for another job -------------------------------
def test_offload_bench_refuses_a_checkpoint_in_another_variants_slot(stem_ckpt, tmp_path, monkeypatch, capsys):
    slot = _slot(stem_ckpt, tmp_path, "stem_half")
    out = tmp_path / "reports" / "tiny" / "offload" / "stem_half"
    code, line = _entry(monkeypatch, capsys, "bench_offload", [
        "--spec", json.dumps({"batch": 1, "prompt": 4, "steps": 4, "repeats": 1}), "--checkpoint", str(slot),
        "--json", str(out / "offload.json"), "--md", str(out / "offload.md")])
    assert code == 1 and line == (f"error: checkpoint {slot / 'config.json'}: not the one this offload benchmark is "
                                  "for (saved job tiny/350m/stem/pretrain, expected tiny/350m/stem_half/pretrain: "
                                  "variant 'stem' != 'stem_half')")
    assert not out.exists()
    code, line = _cli(["eval", "--checkpoint", str(slot), "--suite", "ppl", "--experiment", "tiny"], capsys)
    assert code == 1 and line == (f"error: checkpoint {slot / 'config.json'}: saved job tiny/350m/stem/pretrain, but "
                                  "this eval job is for tiny/350m/stem_half/pretrain (variant 'stem' != 'stem_half')")


def test_analysis_refuses_a_foreign_checkpoint_and_a_foreign_baseline(stem_ckpt, tmp_path, monkeypatch, capsys):
    slot = _slot(stem_ckpt, tmp_path, "hashmoe")
    out = tmp_path / "heaps.json"
    code, line = _entry(monkeypatch, capsys, "analyze", ["--spec", json.dumps({"analysis": "heaps"}),
                                                         "--checkpoint", str(slot), "--out", str(out)])
    assert code == 1 and line.startswith(f"error: checkpoint {slot / 'config.json'}: not the one this analysis job is "
                                         "for (saved job tiny/350m/stem/pretrain, expected tiny/350m/hashmoe/pretrain")
    assert not out.exists()
    from stem.analysis.common import load_baseline
    job = {"experiment": "tiny", "scale": "350m", "variant": "stem", "stage": "pretrain"}
    with pytest.raises(ValueError, match=r"not the one this analysis job's baseline \(dense\) is for .*variant "
                                         r"'stem' != 'dense'"):
        load_baseline(stem_ckpt, {"job": job, "baseline": "dense", "baseline_checkpoint": str(_slot(stem_ckpt, tmp_path, "dense"))})


# ---- offload: a truncated model.safetensors names the file --------------------------------------------------------
def test_offload_of_truncated_weights_names_the_file(stem_ckpt, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(stem_ckpt, ckpt)
    weights = ckpt / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    from stem.eval.lm import load_for_eval
    with pytest.raises(ValueError, match=f"^checkpoint {ckpt}: {weights}: truncated safetensors file") as e:
        load_for_eval(ckpt, "cpu", offload=True)
    assert "\n" not in str(e.value)
    code, line = _cli(["bench", "offload", "--checkpoint", str(ckpt), "--steps", "2", "--prompt", "2",
                       "--json", str(tmp_path / "o.json")], capsys)
    assert code == 1 and line.startswith(f"error: {weights}: unreadable safetensors file")
    assert not (tmp_path / "o.json").exists()


# ---- TensorBoard: a folder that cannot be created --------------------------------------------------------------
def test_tensorboard_folder_that_cannot_be_created_is_one_line(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("not a folder")
    spec = make_spec(tiny_data, out, tensorboard=True, steps=2)
    with pytest.raises(TrainingError, match=f"^{out / 'tensorboard'}: a file, not a folder"):
        train(spec, threads=1)
    capsys.readouterr()   # as workflow_scripts.train reports it (its signal handlers stay out of this process)
    with pytest.raises(SystemExit) as e:
        run_entry(lambda: train(spec, threads=1))
    code, line = e.value.code, _one_line(capsys.readouterr().err)
    assert code == 1 and line.startswith(f"error: {out / 'tensorboard'}: a file, not a folder")
    assert not (out / "checkpoint").exists() and not (out / "summary.json").exists()


# ---- the entry points' own arguments ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--spec", "{not json"], "error: --spec: not valid JSON (Expecting property name enclosed in double quotes at "
                              "column 2); expected the job spec object"),
    (["--spec", "[1]"], "error: --spec: a JSON list; expected the job spec object"),
    (["--spec", "{}", "--threads", "x"], "error: analyze: argument --threads: x: expected a whole number >= 1 (CPU threads)"),
])
def test_entry_point_arguments_are_one_line(tmp_path, monkeypatch, capsys, argv, message):
    code, line = _entry(monkeypatch, capsys, "analyze", [*argv, "--checkpoint", str(tmp_path), "--out",
                                                         str(tmp_path / "o.json")])
    assert code == 1 and line == message


@pytest.mark.parametrize("module, keys, outputs", [
    ("report_tables", None, ["--out-dir", "tables"]),
    ("params", ("experiment", "archs", "variant_overrides"), ["--csv", "p.csv", "--md", "p.md"])])   # rule params
def test_report_entry_points_refuse_a_bad_config_before_writing(tmp_path, monkeypatch, capsys, module, keys, outputs):
    """The report's jobs type their --spec (the config, or the params job's part of it) before anything is
    written: one line naming the key, the value and what is expected."""
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["archs"]["350m"]["d_model"] = 0
    spec = {k: cfg[k] for k in keys} if keys else cfg
    monkeypatch.chdir(tmp_path)
    code, line = _entry(monkeypatch, capsys, module, ["--spec", json.dumps(spec), *outputs])
    assert code == 1 and line == "error: --spec: key 'archs.350m.d_model': 0; expected an integer >= 1"
    assert list(tmp_path.iterdir()) == []


# ---- issue 33: no silent wrong results ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def short_lm(stem_ckpt):
    """The STEM checkpoint as an lm-eval model with a 24-token context: any real prompt must be cut."""
    from stem.eval.lm import StemLM
    return StemLM(str(stem_ckpt), device="cpu", batch_size=4, max_length=24)


def _instance(kind, args, task):
    from lm_eval.api.instance import Instance
    return Instance(kind, {}, args, 0, metadata=(task, 0, 1))


LONG = "The capital of Sarland is Bondo and the capital of Velia is Turo. " * 6


def test_truncation_error_refuses_a_request_that_must_be_cut_in_one_line(short_lm):
    short_lm.set_truncation("error")
    n_gen, n_ll = len(short_lm.tok_encode(LONG)), sum(map(len, short_lm._encode_pair(LONG, " Bondo")))
    for call, n, room in [
            (lambda: short_lm.generate_until([_instance("generate_until", (LONG, {"max_gen_toks": 4}), "bbh_x")]),
             n_gen, 20),   # 24 less the 4 generated tokens
            (lambda: short_lm.loglikelihood([_instance("loglikelihood", (LONG, " Bondo"), "bbh_x")]), n_ll, 25)]:
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == (f"truncation=error: a request of task bbh_x has {n} tokens, more than the {room} the "
                                "model's context leaves it (max_length 24); expected a prompt that fits, or the "
                                "suite's truncation: left or middle")
    short_lm.set_truncation("error")   # a request that fits passes, counted
    short_lm.generate_until([_instance("generate_until", ("The capital", {"max_gen_toks": 2}), "bbh_x")])
    assert short_lm.truncation_counts == {"bbh_x": {"requests": 1, "truncated": 0, "tokens_dropped": 0}}


@torch.no_grad()
def test_middle_truncation_keeps_the_first_and_last_halves(short_lm):
    """LongBench's pred.py exactly (issue 43 item 8): tokens[:half] + tokens[-half:], half = room // 2 (55 + 55 at
    room 111, not 55 + 56); a log-likelihood request's continuation is kept whole outside the halves."""
    from stem.eval.lm import truncate
    assert truncate(list(range(10)), 6, "middle") == [0, 1, 2, 7, 8, 9]
    assert truncate(list(range(10)), 5, "left") == [5, 6, 7, 8, 9]
    tokens, room = list(range(300)), 111
    half = room // 2   # pred.py: half = int(max_length / 2); tokens[:half] + tokens[-half:]
    assert truncate(tokens, room, "middle") == tokens[:half] + tokens[-half:] and half == 55
    assert truncate(list(range(20)), 9, "middle", keep_last=2) == [0, 1, 2, 15, 16, 17, 18, 19]
    short_lm.set_truncation("middle")
    ctx, cont = short_lm._encode_pair(LONG, " Bondo")
    (lp, _), = short_lm.loglikelihood([_instance("loglikelihood", (LONG, " Bondo"), "longbench_x")])
    whole = ctx + cont   # the model sees input whole[:-1] of those kept: the context's halves of the room the
    half = (25 - len(cont)) // 2   # continuation leaves, then the continuation
    kept = ctx[:half] + ctx[-half:] + cont
    logp = torch.log_softmax(short_lm.model(torch.tensor([kept[:-1]]))[0].float(), -1)
    direct = sum(float(logp[len(kept) - len(cont) - 1 + i, t]) for i, t in enumerate(cont))
    assert lp == pytest.approx(direct, abs=1e-4)
    assert short_lm.truncation_counts == {"longbench_x": {"requests": 1, "truncated": 1,
                                                          "tokens_dropped": len(whole) - len(kept)}}
    short_lm.generate_until([_instance("generate_until", (LONG, {"max_gen_toks": 4}), "longbench_y")])
    assert short_lm.truncation_counts["longbench_y"]["tokens_dropped"] == len(short_lm.tok_encode(LONG)) - 20


def test_suite_truncation_defaults_to_the_published_protocol_and_is_checked():
    from stem.eval import spec as ES
    raw = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg = C.experiment.parse(raw, "tiny.yaml")
    assert {s: ES.suite_spec(cfg, s)["truncation"] for s in ("longbench", "bbh", "commonsense", "niah")} == {
        "longbench": "middle", "bbh": "left", "commonsense": "left", "niah": "error"}
    assert ES.default_truncation({"kind": "lm_eval", "tasks": ["ruler"]}) == "error"   # lm-eval's RULER NIAH
    assert ES.default_truncation({"kind": "lm_eval", "tasks": ["longbench_lcc", "bbh"]}) == "left"   # no one rule
    for suite, value, message in [("bbh", "right", "expected one of error, left, middle"),
                                  ("niah", "left",
                                   "expected error (NIAH prompts are built to fit their cells, never cut)")]:
        bad = copy.deepcopy(raw)
        bad["eval"]["suites"][suite]["truncation"] = value
        with pytest.raises(C.ConfigError) as e:
            C.experiment.parse(bad, origin="bad.yaml")
        assert str(e.value) == f"bad.yaml: key 'eval.suites.{suite}.truncation': {value!r}; {message}"


def test_niah_run_refuses_a_cell_longer_than_the_context(short_lm):
    from stem.eval import niah
    items = [{"length": 1536, "depth": 0, "key": "k", "value": "1234567", "prompt": "One of the special magic "
              "numbers for k is: 1234567." + niah.query_of("k")}]
    with pytest.raises(ValueError, match=r"^niah: lengths \[1536\] exceed the checkpoint's context \(24 tokens\)$"):
        niah.run(short_lm, items)


# ---- a mid-training insertion's source and init: refused by the config check (the dry run), naming the key -----
@pytest.mark.parametrize("insert, message", [
    ({"from": "stem"}, "key 'insert.from': 'stem' has ffn 'stem'; expected a dense variant (the insertion builds the "
                       "STEM tables from its dense up-projections)"),
    ({"from": "dse"}, "key 'insert.from': 'dse' has a DSE memory; expected a dense variant"),
    ({"init": "zeros"}, "key 'insert.init': 'zeros'; expected one of projected, raw, xavier"),
    ({"init": "calibrated", "calibration": None}, "key 'insert.calibration': None; init 'calibrated' needs a "
                                                  "calibration source"),
    ({"init": "calibrated", "calibration": {"source": "essays"}}, "key 'insert.calibration.source': 'essays' is not "
                                                                  "a source; expected one of"),
    ({"init": "xavier", "calibration": {"tokens": 64}}, "key 'insert.calibration': set, but insert.init is 'xavier'"),
    ({"init": "calibrated", "calibration": {"tokens": 0}}, "key 'insert.calibration.tokens': 0; expected"),
])
def test_insertion_from_a_non_dense_variant_or_with_a_bad_init_is_refused_by_the_config_check(tmp_path, capsys,
                                                                                                insert, message):
    cfg = C.read_yaml(C.REPO / "config" / "paper.yaml")
    cfg["variant_overrides"] = {**cfg.get("variant_overrides", {}), "stem_insert": {"insert": insert}}
    with pytest.raises(C.ConfigError) as e:
        C.experiment.parse(copy.deepcopy(cfg), origin="bad.yaml")
    assert str(e.value).startswith(f"bad.yaml: variant 'stem_insert' (config/variants.yaml + variant_overrides): "
                                   f"{message}")
    path = tmp_path / "bad.yaml"   # the command line (and the workflow's dry run) say so before any job starts
    path.write_text(yaml.safe_dump(cfg))
    code, line = _cli(["memory", "--config", str(path)], capsys)
    assert code == 1 and line.startswith(f"error: {path}: variant 'stem_insert' ") and message in line


# ---- export-hf: nothing but a previous export is replaced; no temp folder outlives an interrupted export ---------
def test_export_hf_refuses_what_is_not_a_previous_export_and_cleans_up_after_an_interrupted_one(stem_ckpt, tmp_path,
                                                                                                 capsys):
    from stem.io import make_temp_dir
    out = tmp_path / "hf"
    out.write_text("my notes")
    code, line = _cli(["export-hf", str(stem_ckpt), str(out)], capsys)
    assert code == 1 and line == (f"error: export-hf OUT {out}: a file; expected a new path, an empty folder or a "
                                  "previous export (--force replaces it, or remove it)")
    assert out.read_text() == "my notes"
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    code, line = _cli(["export-hf", str(stem_ckpt), str(other)], capsys)
    assert code == 1 and "a folder that is not an export (no stem_source.json)" in line and (other / "sub").is_dir()
    # an export killed mid-way leaves its temp folder (atomic_dir's name); the rerun removes it
    stale = make_temp_dir(tmp_path, ".hf.tmp-")
    (stale / "model.safetensors").write_bytes(b"half")
    from stem.__main__ import main
    main(["export-hf", "--force", str(stem_ckpt), str(out)])
    main(["export-hf", str(stem_ckpt), str(out)])   # a previous export is replaced without --force
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "other"] and (out / "stem_source.json").is_file()


# ---- import-hf: a tokenizer with ids the embedding does not have ----------------------------------------------
def test_import_hf_refuses_a_tokenizer_larger_than_the_embedding(stem_ckpt, tmp_path, capsys):
    import transformers
    for vocab in (500, 600):   # the tokenizer's ids are 0..511
        cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=0)
        src = tmp_path / f"hf{vocab}"
        transformers.LlamaForCausalLM(cfg).save_pretrained(src)
        shutil.copyfile(stem_ckpt / "tokenizer.json", src / "tokenizer.json")
        capsys.readouterr()
        if vocab == 500:
            code, line = _cli(["import-hf", str(src), str(tmp_path / "ckpt")], capsys)
            assert code == 1 and line == (f"error: {src / 'tokenizer.json'}: token ids up to 511, but the model's "
                                          "embedding has 500 rows (vocab_size); expected a tokenizer with ids < 500")
            assert not (tmp_path / "ckpt").exists() and [p.name for p in tmp_path.iterdir()] == ["hf500"]
        else:   # a padded vocabulary is fine, and said
            from stem.__main__ import main
            main(["import-hf", str(src), str(tmp_path / "ckpt")])
            assert (f"{src / 'tokenizer.json'}: 512 token ids for an embedding of 600 rows (a padded vocabulary: "
                    "rows 512..599 are never looked up)") in capsys.readouterr().err
            assert (tmp_path / "ckpt" / "model.safetensors").is_file()


def test_host_tables_on_several_gpus_are_refused_by_the_config_check():
    """Host tables (issue 29) live in one host's memory: a config giving a job several GPUs is refused at the
    config check (the dry run), not when the job starts."""
    cfg = C.read_yaml(C.REPO / "config" / "paper.yaml")
    cfg["cluster"]["tables"] = "host"
    with pytest.raises(C.ConfigError) as e:
        C.experiment.parse(copy.deepcopy(cfg), origin="bad.yaml")
    assert str(e.value) == ("bad.yaml: key 'cluster.tables': host keeps the tables in one host's memory, for jobs of "
                            "one GPU; cluster.train.350m gives 1 x 8 GPUs (expected rows or fsdp)")


def test_insertion_step0_names_a_manifest_path_that_is_not_a_manifest(stem_ckpt, tmp_path, capsys):
    """Issue 43 item 5: a summary.json given as the manifest is named (not the manifest.json beside it), with what
    it is not; nothing is written."""
    summary = stem_ckpt.parent / "summary.json"
    code, line = _cli(["insertion-step0", str(stem_ckpt), str(summary), str(tmp_path / "out.json")], capsys)
    assert code == 1 and line.startswith(f"error: {summary}: not a token-shard manifest (expected the manifest.json ")
    code, line = _cli(["insertion-step0", str(stem_ckpt), str(tmp_path / "nope.json"), str(tmp_path / "out.json")],
                      capsys)
    assert code == 1 and line.startswith(f"error: {tmp_path / 'nope.json'}: no such file (expected a tokens manifest")
    assert list(tmp_path.iterdir()) == []


def test_a_tied_model_from_an_untied_source_refuses_to_drop_its_trained_head(tmp_path):
    """Issue 43 item 1: a stage whose model ties (tie_embeddings: true) starting from an untied source whose head is
    not its embedding is refused in one line naming the option and the measured difference (it dropped the head,
    then read logit diff 7.66); a head equal to the embedding loads; a tied source with a head of its own too."""
    import transformers
    from safetensors.torch import load_file, save_file
    from stem.hf import importer
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    src = tmp_path / "hf"
    transformers.LlamaForCausalLM(cfg).save_pretrained(src)
    weights = load_file(str(src / "model.safetensors"))
    imported, tied = importer.model_config(src)
    want = dataclasses.replace(imported, tie_embeddings=True)
    d = (weights["lm_head.weight"] - weights["model.embed_tokens.weight"]).abs().max().item()
    with pytest.raises(ValueError, match=re.escape(
            f"{src}: tie_embeddings: true (the model's arch) ties the head to the embedding, but this untied source's "
            f"lm_head.weight is not its embedding (max |lm_head - embed_tokens| {d:.4g}): tying would drop the "
            "trained head; set tie_embeddings: false (untied) or start from a tied source")):
        importer.load_for_stage(str(src), want)
    assert torch.equal(importer.load_for_stage(str(src), imported)[0]["lm_head.weight"], weights["lm_head.weight"])
    save_file({**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()}, str(src / "model.safetensors"))
    state, _ = importer.load_for_stage(str(src), want)   # a head equal to the embedding: nothing is lost
    assert "lm_head.weight" not in state and torch.equal(state["tok_emb.weight"], weights["model.embed_tokens.weight"])
    with pytest.raises(ValueError, match=re.escape(f"{src}: tie_word_embeddings is true, but its lm_head.weight is "
                                                   "not its embedding (max |lm_head - embed_tokens| ")):
        importer.pipeline_state(src, True, keep_tied=True, weights=weights)


@pytest.mark.parametrize("key", ["host_mem_gbs", "host_core_gbs"])
def test_host_bandwidth_settings_below_zero_are_refused_in_one_line(key):
    """Issue 42 item 1: the host side's stated bandwidths (stem.train.comms.host_update) must be positive."""
    cfg = C.read_yaml(C.REPO / "config" / "rehearsal.yaml")
    cfg["cluster"][key] = 0
    with pytest.raises(C.ConfigError) as e:
        C.experiment.parse(copy.deepcopy(cfg), origin="bad.yaml")
    assert str(e.value).startswith(f"bad.yaml: key 'cluster.{key}': 0") and "\n" not in str(e.value)


@pytest.mark.parametrize("cluster, message", [
    ({"host_workers": 0}, "key 'cluster.host_workers': 0"),
    ({"tables": "rows", "fit_memory": False, "host_workers": 2},
     "key 'cluster.host_workers': 2 overlaps the host tables' update; expected cluster.tables: host (or "
     "cluster.fit_memory: true, which may choose them), or no host_workers")])
def test_host_workers_below_one_or_without_host_tables_are_refused(cluster, message):
    """Issue 42: the host update's worker threads (cluster.host_workers, RowSparseAdamW.overlap): at least one, and
    only where host tables may be used; one line naming the key, at the config check (nothing runs, nothing is
    written)."""
    cfg = C.read_yaml(C.REPO / "config" / "rehearsal.yaml")
    cfg["cluster"].update(cluster)
    with pytest.raises(C.ConfigError) as e:
        C.experiment.parse(copy.deepcopy(cfg), origin="bad.yaml")
    assert str(e.value).startswith(f"bad.yaml: {message}") and "\n" not in str(e.value)
