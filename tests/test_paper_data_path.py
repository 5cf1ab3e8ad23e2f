"""The paper's data path offline: fixture datasets in each source's real format (hub folders of parquet
or JSON lines .zst with the hub's config layout, ProLong MDS written by mosaicml-streaming's own writer),
read with config/paper.yaml's own source specs, and a reduced paper-shaped config run through Snakemake
tokenize -> pretrain -> midtrain -> extend -> NIAH on the CPU; a killed tokenize job reruns alone."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from stem.data.shards import ShardSet, content_keys, doc_uniform, SAMPLE_SALT, tokenize_to_shards
from stem.data.sources import streaming_format, iter_documents
from stem.data.tokenizer import load_tokenizer, train_bpe

pytest.importorskip("datasets")
pytest.importorskip("zstandard")
REPO = Path(__file__).resolve().parents[1]
PAPER = yaml.safe_load((REPO / "config/paper.yaml").read_text())

# What the hub holds (dataset cards, checked 2026-11-23; research notes F), written independently of
# config/paper.yaml: per dataset, its file format and, per config, the columns of its rows. The fixtures
# are built from this table, then read with paper.yaml's specs: a wrong config, format or field fails.
HUB = {
    "allenai/olmo-mix-1124": {"format": "json", "configs": {None: ["text", "id", "source"]}},
    "nvidia/Nemotron-CC-Math-v1": {"format": "parquet",
                                   "configs": {"3": ["text", "id"], "4plus": ["text", "id"], "4plus_MIND": ["text", "id"]}},
    "nvidia/Nemotron-Pretraining-Code-v1": {"format": "parquet",
                                            "configs": {"Synthetic-Code": ["text", "id"],
                                                        "Nemotron-Code-Metadata": ["repo", "commit_id", "rel_path"]}},
}
MDS_COLUMNS = {"input_ids": "ndarray:uint32", "indices": "ndarray:uint32", "length": "uint64", "domain": "str"}
WORDS = ("the cat sat on a mat while seven quiet rivers ran past old stone bridges into the sea "
         "def return import class for while if else print value index").split()


def _text(rng, n):
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def write_hub_folder(root: Path, dataset: str, n_files=2, docs_per_file=12, seed=0) -> Path:
    """A local folder laid out like the hub repo: a README with its configs, data files per config."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    rng = random.Random(seed)
    info, folder = HUB[dataset], root / dataset.replace("/", "__")
    configs = []
    for name, cols in info["configs"].items():
        sub = folder / (name or "data")
        sub.mkdir(parents=True, exist_ok=True)
        ext = "parquet" if info["format"] == "parquet" else "jsonl.zst"
        configs.append({"config_name": name or "default",
                        "data_files": [{"split": "train", "path": f"{sub.name}/*.{ext}"}]})
        for f in range(n_files):
            rows = [{c: _text(rng, rng.randint(20, 60)) if c == "text" else f"{c}-{f}-{i}" for c in cols}
                    for i in range(docs_per_file)]
            if ext == "parquet":
                pq.write_table(pa.Table.from_pylist(rows), sub / f"part-{f:05d}.parquet")
            else:
                with zstandard.open(sub / f"part-{f:05d}.jsonl.zst", "wt") as fh:
                    fh.writelines(json.dumps(r) + "\n" for r in rows)
    (folder / "README.md").write_text("---\n" + yaml.safe_dump({"configs": configs}) + "---\n")
    return folder


def write_prolong(root: Path, tok, domains, rows_per_domain=3, row_len=256, seed=0) -> Path:
    """ProLong-shaped MDS folders (domain/procNN-64/) written by mosaicml-streaming's MDSWriter: rows of
    row_len packed token ids with the documents' (start, end) pairs."""
    rng = random.Random(seed)
    fmt = streaming_format()
    for d in domains:
        with fmt.MDSWriter(out=str(root / d / "proc00-64"), columns=MDS_COLUMNS, size_limit=1 << 11) as w:
            for _ in range(rows_per_domain):
                ids, bounds = [], []
                while len(ids) < row_len:
                    doc = tok.encode_batch([_text(rng, rng.randint(10, 80))])[0][: row_len - len(ids)]
                    bounds.append((len(ids), len(ids) + len(doc)))
                    ids += doc
                w.write({"input_ids": np.array(ids, np.uint32), "indices": np.array(bounds, np.uint32),
                         "length": row_len, "domain": d})
    return root


def prolong_domains(spec):
    return [p.split("prolong-data-64K/")[1].rstrip("/*") for p in spec["paths"]]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    folders = {ds: write_hub_folder(root, ds, seed=i) for i, ds in enumerate(HUB)}
    docs = [d for ds in folders for d in iter_documents(_local(PAPER["sources"], ds, folders))]
    tok_path = root / "tokenizer.json"
    train_bpe(iter(docs * 4), 400, tok_path)
    tok = load_tokenizer(tok_path)
    domains = prolong_domains(PAPER["sources"]["prolong_long"]) + prolong_domains(PAPER["sources"]["prolong_short"])
    write_prolong(root / "prolong-data-64K", tok, domains)
    return {"root": root, "folders": folders, "tok_path": tok_path, "tok": tok}


def _local(sources, dataset, folders):
    """paper.yaml's spec of the (first) source reading ``dataset``, pointed at the local fixture folder."""
    spec = next(s for s in sources.values() if s.get("path") == dataset)
    keep = ("kind", "path", "name", "split", "text_field", "data_files", "format")
    return {**{k: v for k, v in spec.items() if k in keep}, "path": str(folders[dataset])}


def _local_sources(world, vocab_size):
    out = {}
    for name, spec in PAPER["sources"].items():
        spec = json.loads(json.dumps(spec))  # a deep copy: PAPER stays as read
        if spec["kind"] == "hf":
            spec["path"] = str(world["folders"][spec["path"]])
        else:
            spec["paths"] = [p.replace("data/hub", str(world["root"])) for p in spec["paths"]]
            spec["vocab_size"] = vocab_size
        out[name] = spec
    return out


# ----------------------------------------------------------------------------- readers vs paper.yaml


@pytest.mark.parametrize("name", [n for n, s in PAPER["sources"].items() if s["kind"] == "hf"])
def test_paper_hub_sources_read_their_real_layout(world, name):
    spec = {k: v for k, v in PAPER["sources"][name].items() if k not in ("parts", "doc_keys", "sample", "max_tokens")}
    hub = HUB[spec["path"]]
    assert spec.get("format") == hub["format"] and spec.get("name") in hub["configs"]
    spec["path"] = str(world["folders"][spec["path"]])
    docs = list(iter_documents(spec))
    assert len(docs) == 24 and all(isinstance(d, str) and d.endswith(".") for d in docs)
    # the two parts of a scattered read partition the documents (one file each)
    parts = [list(iter_documents(spec, part=(k, 2))) for k in range(2)]
    assert parts[0] + parts[1] == docs and parts[0] and parts[1]


def test_wrong_config_format_or_field_is_one_clear_error(world):
    code = {k: v for k, v in PAPER["sources"]["nemotron_code"].items() if k in ("kind", "name", "split", "text_field", "format")}
    code["path"] = str(world["folders"]["nvidia/Nemotron-Pretraining-Code-v1"])
    with pytest.raises(ValueError, match=r"config 'Nemotron-Code-Metadata'\): no text_field 'text'; columns are"):
        next(iter_documents({**code, "name": "Nemotron-Code-Metadata"}))
    with pytest.raises(ValueError, match="BuilderConfig 'Code' not found"):
        next(iter_documents({**code, "name": "Code"}))
    with pytest.raises(ValueError, match="its files are 'parquet' but the source spec says format 'json'"):
        next(iter_documents({**code, "format": "json"}))
    with pytest.raises(ValueError, match="format 'mds' is not one of"):
        next(iter_documents({**code, "format": "mds"}))


def test_prolong_mds_keeps_its_ids_and_document_boundaries(world, tmp_path):
    spec = dict(PAPER["sources"]["prolong_long"])
    assert (spec["kind"], spec["ids_field"], spec["indices_field"], spec["vocab_size"]) == ("mds", "input_ids", "indices", 128256)
    spec = _local_sources(world, world["tok"].vocab_size)["prolong_long"]
    # reference: the rows as the streaming library's own reader returns them, cut at `indices`
    fmt, expect = streaming_format(), []
    for d in prolong_domains(PAPER["sources"]["prolong_long"]):
        folder = world["root"] / "prolong-data-64K" / d / "proc00-64"
        index = json.loads((folder / "index.json").read_text())
        for sh in index["shards"]:
            r = fmt.reader_from_json(str(folder), None, sh)
            for i in range(r.samples):
                row = r.get_item(i)
                expect += [row["input_ids"][a:b].tolist() for a, b in row["indices"].reshape(-1, 2)]
    docs = [d.tolist() for d in iter_documents({k: spec[k] for k in ("kind", "paths", "ids_field", "indices_field", "vocab_size")})]
    assert docs == expect and len(docs) > 9
    # tokenized as they are: each document's ids then eos, a document start at each boundary
    m = tokenize_to_shards(iter_documents({k: spec[k] for k in ("kind", "paths", "ids_field", "indices_field", "vocab_size")}),
                           world["tok"], tmp_path / "t", val_fraction=0.0)
    ss = ShardSet(tmp_path / "t", "train")
    eos = world["tok"].eos_id
    assert ss.get(0, ss.tokens).tolist() == [t for d in expect for t in d + [eos]]
    assert ss.doc_starts.tolist() == np.cumsum([0] + [len(d) + 1 for d in expect[:-1]]).tolist()
    assert m["splits"]["train"]["documents"] == len(expect)


def test_mds_tokenizer_vocabulary_mismatch_is_refused(world, tmp_path):
    from stem.pipeline import tokenize
    spec = _local_sources(world, 128256)["prolong_long"]
    docs = {k: spec[k] for k in ("kind", "paths", "ids_field", "indices_field", "vocab_size")}
    with pytest.raises(ValueError, match=r"tokenizer has \d+ tokens but the MDS source .* stores ids of a 128256-token vocabulary"):
        tokenize({"documents": docs, "seed": 0, "vocab_size": 128256}, world["tok_path"], tmp_path / "o")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- sampling


def test_sampling_is_a_seeded_document_hash_over_the_whole_source(world, tmp_path):
    """keep iff u(seed ^ salt, blake2b(doc)) in [lo, hi): recomputed here with hashlib and a
    reimplementation of splitmix64; disjoint ranges give disjoint documents; parts agree."""
    import hashlib

    spec = _local(PAPER["sources"], "allenai/olmo-mix-1124", world["folders"])
    docs = list(iter_documents(spec))

    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) % 2**64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
        return x ^ (x >> 31)

    def u(doc, seed):
        key = int.from_bytes(hashlib.blake2b(doc.encode(), digest_size=8).digest(), "little")
        return (mix(key ^ mix(seed)) >> 11) * 2.0**-53

    seed = 7
    assert np.allclose(doc_uniform(content_keys(docs), seed ^ SAMPLE_SALT), [u(d, seed ^ SAMPLE_SALT) for d in docs])
    kept = {}
    for rng_ in ([0.0, 0.5], [0.5, 1.0]):
        for k in range(2):
            m = tokenize_to_shards(iter_documents(spec, part=(k, 2)), world["tok"], tmp_path / f"{rng_[0]}-{k}",
                                   seed=seed, val_fraction=0.0, doc_keys="content", sample=rng_, allow_empty=True)
            kept[(rng_[0], k)] = m["splits"]["train"]["documents"]
    lo = sum(u(d, seed ^ SAMPLE_SALT) < 0.5 for d in docs)
    assert kept[(0.0, 0)] + kept[(0.0, 1)] == lo and kept[(0.5, 0)] + kept[(0.5, 1)] == len(docs) - lo
    assert 0 < lo < len(docs)


# ----------------------------------------------------------------------------- through Snakemake

SNAKEMAKE = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile")]


def snakemake(*args, cwd, warm=False, **kw):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    warm_start = [sys.executable, "-m", "stem.warm", "--"] if warm else []   # as make smoke runs it (stem/warm.py)
    return subprocess.run([*warm_start, *SNAKEMAKE, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600, **kw)


def reduced_paper_config(world, tmp_path) -> Path:
    """config/paper.yaml with tiny shapes, few steps, the fixture folders and the fixture tokenizer."""
    cfg = json.loads(json.dumps(PAPER))
    V = world["tok"].vocab_size
    cfg.update(device="cpu", matrix={"1b": {"variants": ["stem"], "stages": ["pretrain", "midtrain", "extend"]}})
    cfg["archs"] = {"1b": {**cfg["archs"]["1b"], "vocab_size": V, "d_model": 32, "n_layers": 3, "n_heads": 2,
                           "n_kv_heads": 1, "d_ff": 48, "max_seq_len": 64}}
    cfg["tokenizer"] = {"1b": {"kind": "pretrained", "path": str(world["tok_path"])}}
    cfg["sources"] = _local_sources(world, V)
    for name, src in cfg["sources"].items():  # scattered: the pretraining web set and ProLong's long set
        src["parts"] = 2 if name in ("olmo_mix", "prolong_long") else 1
        src.pop("max_tokens", None)
    # 24 fixture documents: wider (still disjoint) sample ranges than the paper's 0.28 / 0.02
    cfg["sources"]["olmo_mix"]["sample"]["1b"] = [0.0, 0.6]
    cfg["sources"]["olmo_mix_mid"]["sample"]["1b"] = [0.6, 1.0]
    for stage in ("pretrain", "midtrain", "extend"):
        spec = cfg["stages"][stage]["1b"]
        spec.update(steps=2, batch_size=2, micro_batch=2, seq_len=32 if stage != "extend" else 256)
        spec.pop("schedule_steps", None)
    cfg["stages"]["extend"]["1b"]["max_seq_len"] = 256
    cfg["stages"] = {st: {"1b": cfg["stages"][st]["1b"]} for st in ("pretrain", "midtrain", "extend")}
    cfg["train"] = {"log_interval": 1, "eval_interval": 2, "eval_batches": 1, "checkpoint_interval": 2}
    cfg.pop("sweeps")   # they train at 350m, which this config drops
    cfg["cluster"] = {"tokenize": {"cpus": 1}}  # local run: two part jobs at a time on 2 cores
    suites = cfg["eval"]["suites"]
    cfg["eval"] = {**cfg["eval"], "stages": {"extend": ["niah"]},
                   "suites": {"niah": {**suites["niah"], "lengths": [192, 256], "depths": [0, 50, 100], "samples": 1}}}
    path = tmp_path / "paper_reduced.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_reduced_paper_config_runs_tokenize_to_niah_through_snakemake(world, tmp_path):
    cfg = reduced_paper_config(world, tmp_path)
    args = ["--configfile", str(cfg), "--replace-workflow-config", "-d", str(tmp_path), "--cores", "2"]
    target = "results/paper/1b/stem/extend/eval/niah.json"
    r = snakemake(*args, target, cwd=tmp_path, warm=True)
    assert r.returncode == 0, r.stderr[-3000:]
    niah = json.loads((tmp_path / target).read_text())
    assert niah["tasks"]["niah"]["n"] == 2 * 3 * 1
    # every source went through two scattered parts and one gathered manifest
    for name in ("olmo_mix", "prolong_long"):
        m = json.loads((tmp_path / f"data/paper/1b/tokens/{name}/manifest.json").read_text())
        assert m["parts"] == [f"part{k:05d}-of-00002" for k in range(2)]
        log = (tmp_path / f"logs/paper/1b/tokenize/{name}/part00001-of-00002.log").read_text()
        assert "tokenize part 1/2:" in log and "tokens/s" in log
    # pretraining and midtraining's web share are disjoint samples of the same hub set (u in [0, .28) / [.28, .30))
    keys = {}
    for name in ("olmo_mix", "olmo_mix_mid"):
        ss = ShardSet(tmp_path / f"data/paper/1b/tokens/{name}", "train")
        toks = ss.get(0, ss.tokens)
        starts = list(ss.doc_starts) + [ss.tokens]
        keys[name] = {tuple(toks[a:b]) for a, b in zip(starts[:-1], starts[1:])}
    assert keys["olmo_mix"] and not keys["olmo_mix"] & keys["olmo_mix_mid"]
    ext = json.loads((tmp_path / "results/paper/1b/stem/extend/summary.json").read_text())
    assert set(ext["tokens_by_source"]) == {"prolong_long", "prolong_short"}


def test_a_killed_tokenize_job_reruns_alone(world, tmp_path):
    """Part 1 of 3 reads a named pipe: it blocks mid-way with its temp dir open; the whole Snakemake run
    is killed there. The rerun does only that part and the gather; the other parts are kept."""
    cfg = yaml.safe_load(reduced_paper_config(world, tmp_path).read_text())
    raw = tmp_path / "raw"
    raw.mkdir()
    rng = random.Random(3)
    lines = [[json.dumps({"text": _text(rng, 30)}) + "\n" for _ in range(40)] for _ in range(3)]
    for k in (0, 2):
        (raw / f"f{k}.jsonl").write_text("".join(lines[k]))
    os.mkfifo(raw / "f1.jsonl")
    cfg["sources"]["web"] = {"kind": "files", "paths": [str(raw / "*.jsonl")], "format": "jsonl", "parts": 3}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    args = ["--configfile", str(path), "--replace-workflow-config", "-d", str(tmp_path), "--cores", "6"]
    target = "data/paper/1b/tokens/web/manifest.json"
    tokens = tmp_path / "data/paper/1b/tokens/web"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.Popen([*SNAKEMAKE, *args, target], cwd=tmp_path, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        def finished_parts():  # jobs Snakemake has recorded as done (its log), not only written
            logs = list((tmp_path / ".snakemake/log").glob("*.log"))
            return logs[0].read_text().count("(Rule: tokenize_part)") if logs else 0

        while not (finished_parts() == 2 and list(tokens.glob(".part00001-of-00003.tmp-*"))):
            assert time.time() < deadline and proc.poll() is None, "parts 0 and 2 did not finish"
            time.sleep(0.2)
        assert (tokens / "part00000-of-00003").is_dir() and (tokens / "part00002-of-00003").is_dir()
        with open(raw / "f1.jsonl", "w") as f:  # half of part 1's documents, then the kill
            f.writelines(lines[1][:20])
            f.flush()
            time.sleep(1.0)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert not (tokens / "part00001-of-00003").exists() and not (tokens / "manifest.json").exists()
    kept = {k: (tokens / f"part0000{k}-of-00003/manifest.json").stat().st_mtime_ns for k in (0, 2)}
    (raw / "f1.jsonl").unlink()
    (raw / "f1.jsonl").write_text("".join(lines[1]))
    assert snakemake("--unlock", *args, cwd=tmp_path).returncode == 0
    r = snakemake("-n", *args, target, cwd=tmp_path)
    counts = dict(line.split() for line in r.stdout.split("Job stats:")[1].splitlines()[3:6])
    assert counts == {"tokenize_part": "1", "tokenize_gather": "1", "total": "2"}, r.stdout
    r = snakemake(*args, target, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert {k: (tokens / f"part0000{k}-of-00003/manifest.json").stat().st_mtime_ns for k in (0, 2)} == kept
    assert not list(tokens.glob(".part*tmp-*"))
    m = json.loads((tokens / "manifest.json").read_text())
    assert m["documents_seen"] == 120 and sum(s["documents"] for s in m["splits"].values()) == 120


# ----------------------------------------------------------------------------- files, parts, gather, config


def test_jsonl_zst_files_and_parts_partition_the_documents(tmp_path):
    import zstandard

    texts = [f"document {i} " + "x" * i for i in range(10)]
    for f in range(2):
        with zstandard.open(tmp_path / f"s{f}.jsonl.zst", "wt") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in texts[5 * f : 5 * f + 5])
    spec = {"kind": "files", "paths": [str(tmp_path / "*.jsonl.zst")], "format": "jsonl"}
    assert list(iter_documents(spec)) == texts
    assert [list(iter_documents(spec, part=(k, 2))) for k in range(2)] == [texts[:5], texts[5:]]  # by file
    three = [list(iter_documents(spec, part=(k, 3))) for k in range(3)]  # fewer files than parts: stride
    assert three == [texts[0::3], texts[1::3], texts[2::3]]
    with pytest.raises(ValueError, match=r"part must be \(k, n\) with 0 <= k < n, got \(2, 2\)"):
        iter_documents(spec, part=(2, 2))


def test_gather_concatenates_parts_and_refuses_mismatched_ones(world, tmp_path):
    from stem.data.shards import gather_parts

    texts = [_text(random.Random(i), 30) for i in range(40)]
    for k in range(2):
        tokenize_to_shards(iter(texts[20 * k : 20 * k + 20]), world["tok"], tmp_path / f"p{k}", shard_tokens=100)
    m = gather_parts(tmp_path, [tmp_path / "p0", tmp_path / "p1"])
    tokenize_to_shards(iter(texts), world["tok"], tmp_path / "whole", shard_tokens=100)
    assert m["documents_seen"] == 40 and m["parts"] == ["p0", "p1"]
    def docs(d):  # every document (train and val) as a tuple of tokens
        out = []
        for split in ("train", "val"):
            s = ShardSet(d, split)
            ends = list(s.doc_starts[1:]) + [s.tokens]
            out += [tuple(s.get(a, b - a)) for a, b in zip(s.doc_starts, ends)]
        return sorted(out)

    assert docs(tmp_path) == docs(tmp_path / "whole") and len(docs(tmp_path)) == 40
    assert ShardSet(tmp_path, "train").get(0, 5).tolist() == ShardSet(tmp_path / "p0", "train").get(0, 5).tolist()
    bad = json.loads((tmp_path / "p1/manifest.json").read_text())
    bad["eos_id"] = 7
    (tmp_path / "p1/manifest.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"p1/manifest.json: eos_id 7 differs from .*p0's 0"):
        gather_parts(tmp_path, [tmp_path / "p0", tmp_path / "p1"])


def test_tokenize_spec_splits_caps_and_picks_the_scale_sample():
    from stem import config as C

    cfg = json.loads(json.dumps(PAPER))
    exp = C.experiment.parse(cfg, "paper.yaml")
    s = C.tokenize_spec(exp, "1b", "nemotron_code", "part00003-of-00064")
    assert s["part"] == [3, 64] and s["max_tokens"] == -(-35_000_000_000 // 64) and s["documents"]["name"] == "Synthetic-Code"
    assert C.tokenize_spec(exp, "350m", "olmo_mix", "part00000-of-00256")["sample"] == [0.0, 0.028]
    assert C.tokenize_spec(exp, "1b", "olmo_mix_mid", "part00000-of-00064")["sample"] == [0.28, 0.30]
    with pytest.raises(C.ConfigError, match=r"key 'sources.olmo_mix_mid.sample': no range for scale '350m'"):
        C.tokenize_spec(exp, "350m", "olmo_mix_mid", "part00000-of-00064")
    with pytest.raises(C.ConfigError, match="part 'part00000-of-00002' is not one of its 64 parts"):
        C.tokenize_spec(exp, "1b", "nemotron_code", "part00000-of-00002")
    cfg["sources"]["olmo_mix"]["doc_keys"] = "index"
    with pytest.raises(C.ConfigError, match="key 'sources.olmo_mix.sample' needs doc_keys: content"):
        C.tokenize_spec(C.experiment.parse(cfg, "paper.yaml (doc_keys: index)"), "1b", "olmo_mix", "part00000-of-00256")
