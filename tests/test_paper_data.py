"""Checks reference/paper/*.csv against the paper text, plus the paper's internal arithmetic."""
import math
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from stem.config import variant_labels
from stem.report import paper_data as pdata

PAPER_TXT = Path(__file__).resolve().parents[2] / "shared" / "seeds" / "stem-paper.txt"
CELL_SRC = re.compile(r"^Table (\d+), (?:(.+?), )?row '(.+?)', column '(.+?)'$")
QUOTE_SRC = re.compile(r'text: "(.+?)"')
NOT_IN_PAPER = ("not in the paper", "ASSUMPTION")
ALL_TABLES = pdata.available_tables()


@pytest.fixture(scope="module")
def paper():
    if not PAPER_TXT.exists():
        pytest.skip(f"paper text not found at {PAPER_TXT} (shared seeds folder absent)")
    return PAPER_TXT.read_text(encoding="utf-8")


# ---- test-only look-ups (the pipeline reads whole tables through stem.report.paper_data)
def paper_value(table: str, scale: str | None, variant: str, column: str) -> float:
    """A single published number. ``variant`` may be the variant id or the paper's row label."""
    df = pdata._read(table)
    scale = scale or ""
    rows = df[(df["scale"] == scale) & ((df["variant"] == variant) | (df["row"] == variant))]
    if rows.empty:
        have = sorted(set(df["scale"] + "/" + df["variant"]))
        raise ValueError(f"{table} has no row scale={scale!r} variant={variant!r}; available: {', '.join(have)}")
    hit = rows[rows["column"] == column]
    if len(hit) != 1:
        have = list(dict.fromkeys(rows["column"]))
        raise ValueError(f"{table} {scale}/{variant} has no column {column!r}; available: {', '.join(have)}")
    value = hit["value"].iloc[0]
    if isinstance(value, str):
        raise ValueError(f"{table} {scale}/{variant} {column!r} is text ({value!r}), not a number")
    return float(value)


def load_table1_formulas() -> dict:
    """Table 1's per-layer cost formulas (FFN vs STEM vs savings) as text and printed LaTeX."""
    with open(pdata.PAPER_DIR / "table1_formulas.yaml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def paper_cells(text: str, number: int) -> dict:
    """{(section, row label, column header): cell} for the tab-separated block of Table <number>."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"Table {number} "))
    i = start + 1
    while not lines[i].strip():
        i += 1
    block = []
    while i < len(lines) and lines[i].strip():
        block.append(lines[i].split("\t"))
        i += 1
    header, body = block[0], block[1:]
    if body and body[0][0] == "":  # two-level header (Table 5): forward-fill the group names
        group, names = "", []
        for top, sub in zip(header, body[0]):
            group = top or group
            names.append(f"{group} {sub}".strip() if sub else top)
        header, body = names, body[1:]
    cells, section = {}, ""
    for cols in body:
        if cols[0].startswith("<i>"):
            section = cols[0].removeprefix("<i>").removesuffix("</i>")
            continue
        for head, cell in zip(header[1:], cols[1:]):
            cells[(section, cols[0], head)] = cell
    return cells


def as_value(cell: str):
    cell = cell.strip().replace(",", "")
    try:
        return float(cell.removesuffix("x"))
    except ValueError:
        return cell


def quoted_numbers(quote: str, unit: str) -> list[float]:
    scale = {"billion": 1e9, "trillion": 1e12}
    out = []
    for num, pct, word in re.findall(r"(\d+(?:\.\d+)?)(%?)(?: (billion|trillion))?", quote):
        if unit == "%" and not pct:
            continue
        out.append(float(num) * scale.get(word, 1))
        if pct and unit == "ratio":
            out.append(float(num) / 100)
    return out


def all_rows():
    return pd.concat([pdata.load_table(t) for t in ALL_TABLES], ignore_index=True)


@pytest.mark.parametrize("name", ALL_TABLES)
def test_csv_shape(name):
    df = pdata.load_table(name)
    assert list(df.columns) == pdata.COLUMNS
    assert (df["table"] == name).all()
    assert not df.duplicated(["scale", "variant", "column"]).any()
    assert (df["source"] != "").all()


@pytest.mark.parametrize("rec", all_rows().to_dict("records"), ids=lambda r: f"{r['table']}:{r['scale']}:{r['variant']}:{r['column']}")
def test_value_matches_paper_text(paper, rec):
    src, value = rec["source"], rec["value"]
    if m := CELL_SRC.match(src):
        number, section, row, col = m.groups()
        cells = paper_cells(paper, int(number))
        key = (section or "", row, col)
        assert key in cells, f"{src}: no such cell in the paper"
        expected = as_value(cells[key])
        if isinstance(expected, float):
            assert value == pytest.approx(expected, abs=1e-12), src
        else:
            assert value == expected, src
    elif m := QUOTE_SRC.search(src):
        quote = m.group(1)
        assert quote in paper, f"quote not found verbatim in the paper: {quote!r}"
        assert any(math.isclose(value, n, rel_tol=1e-9) for n in quoted_numbers(quote, rec["unit"])), src
    else:
        assert src.startswith(NOT_IN_PAPER), f"source neither a table cell nor a quote: {src!r}"


@pytest.mark.parametrize("number", [2, 3, 4, 5, 6])
def test_every_paper_cell_transcribed(paper, number):
    df = pdata.load_table(f"table{number}")
    got = set()
    for src in df["source"]:
        if m := CELL_SRC.match(src):
            got.add((m.group(2) or "", m.group(3), m.group(4)))
    assert got == set(paper_cells(paper, number))


def test_table1_formulas_match_paper(paper):
    f = load_table1_formulas()
    cells = [c for phase in ("prefill_training", "decoding") for metric in f[phase].values() for c in metric.values()]
    assert len(cells) == 12
    for c in cells:
        assert c["latex"] in paper, c
    assert f["saving_fraction"]["latex"] in paper


def test_variant_ids_and_labels():
    for t in ["table3", "table4", "table5"]:
        df = pdata.load_table(t)
        assert (df["row"] == df["variant"].map(variant_labels())).all(), t
    for t, tasks in pdata.TASKS.items():
        assert set(tasks) <= set(pdata.load_table(t)["column"]), t


def test_loader_api():
    assert paper_value("table3", "350m", "stem_half", "arc_challenge") == 40.00
    assert paper_value("table3", "1b", "stem", "roi") == 1.08
    assert paper_value("table1_saving_fractions", None, "Qwen2.5-7B", "saving_fraction") == 23.9
    assert paper_value("table2", "1b", "midtrain", "train_steps") == 50000
    assert pdata.load_table("table2").query("column == 'lr_schedule'")["value"].tolist()[2] == "linear"
    with pytest.raises(ValueError, match="unknown paper table 'table9'; available: .*table3"):
        pdata.load_table("table9")
    with pytest.raises(ValueError, match="no row scale='1b' variant='hashmoe'; available: .*350m/hashmoe"):
        paper_value("table3", "1b", "hashmoe", "avg")
    with pytest.raises(ValueError, match="no column 'arc_e'; available: .*arc_easy"):
        paper_value("table3", "1b", "stem", "arc_e")
    with pytest.raises(ValueError, match="is text"):
        paper_value("table2", "1b", "pretrain", "lr_schedule")


# ---- the paper's internal arithmetic -------------------------------------------------------------

def wide(name):
    return pdata.load_table(name).pivot_table(index=["scale", "variant"], columns="column", values="value",
                                             aggfunc="first")


# Rows whose printed Avg is NOT the mean of the 8 tasks (within 0.01). Currently none: the paper agrees.
AVG_MISMATCH = set()


@pytest.mark.parametrize("name", ["table3", "table4"])
def test_avg_is_mean_of_tasks(name):
    w = wide(name)
    diff = (w["avg"] - w[pdata.COMMONSENSE_TASKS].mean(axis=1)).abs()
    assert set(diff[diff > 0.01].index) == AVG_MISMATCH


def test_roi_recomputed_from_avg_and_gflops():
    w = wide("table3")
    for (scale, variant), r in w.iterrows():
        base = w.loc[(scale, "dense")]
        roi = (r["avg"] / r["gflops_per_token"]) / (base["avg"] / base["gflops_per_token"])
        assert roi == pytest.approx(r["roi"], abs=0.006), (scale, variant, roi)


# Paper accounting: GFLOPs/token = 2 x active params. STEM-dagger prints 0.35B active but 0.74 GFLOPs
# (= 2 x 0.37, the dense count; it keeps the up-projection), so one of the two is inconsistent.
GFLOPS_MISMATCH = {("350m", "stem_dagger")}


def test_gflops_is_twice_active_params():
    w = wide("table3")
    diff = (w["gflops_per_token"] - 2 * w["active_params_b"]).abs()
    assert set(diff[diff > 0.016].index) == GFLOPS_MISMATCH


# Table 1 saving fraction d_ff / (4d + 2L + 3 d_ff) with L = 4096 (our assumption). Qwen2.5-3B gives
# 22.3%, the paper prints 22.8%.
SAVING_MISMATCH = {"qwen2.5-3b": 22.28}


def test_table1_saving_fractions_recomputed():
    arch = wide("qwen25_architectures").loc[""]
    frac = wide("table1_saving_fractions").loc[""]["saving_fraction"]
    for variant, a in arch.iterrows():
        ours = 100 * a["d_ff"] / (4 * a["d_model"] + 2 * a["seq_len"] + 3 * a["d_ff"])
        if variant in SAVING_MISMATCH:
            assert ours == pytest.approx(SAVING_MISMATCH[variant], abs=0.01)
            assert abs(ours - frac[variant]) > 0.3
        else:
            assert ours == pytest.approx(frac[variant], abs=0.05), variant


def test_table2_warmup_contradiction_recorded():
    assert paper_value("table2", None, "common", "warmup_ratio") == 0.01
    assert paper_value("table2", None, "sec4_1", "warmup_ratio") == 0.10


def test_table2_steps_match_token_budgets():
    w = wide("table2")[["train_steps", "batch_size", "max_seq_len", "train_tokens"]].astype(float)
    tokens = w["train_steps"] * w["batch_size"] * w["max_seq_len"]
    assert (tokens / w["train_tokens"]).dropna().between(1.0, 1.06).all()


def test_figure1b_gap_order(paper):
    assert paper_value("figure1b", "1b", "stem", "niah_gap_shortest") == 8.4
    assert paper_value("figure1b", "1b", "stem", "niah_gap_longest") == 13


@pytest.mark.parametrize("name", ["table5", "table6"])
def test_stem_never_below_dense_as_claimed(name):
    w = wide(name).loc["1b"]
    assert (w.loc["stem"] >= w.loc["dense"]).all()


# ---- the DSE paper (reference/dse_paper/): its Table 1 and Table 3 ----------------------------------------
DSE_TXT = PAPER_TXT.with_name("conditional-memory-dse-paper.txt")
DSE_SRC = re.compile(r"^DSE paper \(Cheng et al\., .+\), Table (\d), row '(.+?)', column '(.+?)'$")


def _dse_rows(text: str, number: int) -> tuple[list[str], dict]:
    """(model names of the header, {row label: cells after the label}) of the DSE paper's Table 1 or 3."""
    lines = text.splitlines()
    cap = next(i for i, ln in enumerate(lines) if ln.startswith(f"Table {number}: "))
    block = []
    for ln in reversed(lines[:cap]):
        if "\t" not in ln:
            if block:
                break
            continue
        block.insert(0, ln.split("\t"))
    skip = 3 if number == 1 else 1   # Table 1: category, benchmark, shots; Table 3: the row label
    header = [re.sub(r"</?b>", "", c).strip() for c in block[0][skip:]]
    rows = {r[skip - 2 if number == 1 else 0].strip(): [re.sub(r"</?b>", "", c).strip() for c in r[skip:]]
            for r in block[1:]}
    return header, rows


def _numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", cell)]


@pytest.mark.parametrize("name", ["dse_paper/table1", "dse_paper/table3"])
def test_dse_paper_csv_matches_its_text(name):
    if not DSE_TXT.exists():
        pytest.skip(f"DSE paper text not found at {DSE_TXT}")
    df = pdata.load_table(name)
    assert list(df.columns) == pdata.COLUMNS and (df["source"] != "").all()
    assert not df.duplicated(["variant", "column"]).any()
    number = int(name[-1])
    header, rows = _dse_rows(DSE_TXT.read_text(encoding="utf-8"), number)
    assert header == ["Dense-4B", "MoE-27B", "DSE-27B", "DSE-40B"]
    for r in df.itertuples():
        table, row, col = DSE_SRC.match(r.source).groups()
        assert int(table) == number and col == r.row and row in rows, r.source
        cells = rows[row]
        if number == 1:   # one number per model column
            assert _numbers(cells[header.index(col)]) == [r.value], r.source
        else:             # Table 3 merges equal cells; the number is on the row
            assert r.value in _numbers(" ".join(cells)), r.source


def test_dse_paper_claims_dse27b_beats_dense_and_moe_everywhere():
    """The direction the report's dse table checks: DSE-27B above Dense-4B and MoE-27B on every benchmark of
    reference/dse_paper/table1.csv, below both in loss (Sec. 4.2: "consistently improves")."""
    w = pdata.load_table("dse_paper/table1").pivot_table(index="column", columns="variant", values="value")
    bench = w.drop(index=["total_params_b", "active_params_b", "dse_params_b", "train_tokens_b"])
    lower = bench.index.str.endswith("loss")
    for base in ("dense_4b", "moe_27b"):
        assert (bench.loc[~lower, "dse_27b"] > bench.loc[~lower, base]).all()
        assert (bench.loc[lower, "dse_27b"] < bench.loc[lower, base]).all()


def test_dse_paper_table2_csv_matches_its_text():
    """reference/dse_paper/table2.csv: the twelve numbers of each row of the DSE paper's Table 2 (long context), in
    its column order."""
    if not DSE_TXT.exists():
        pytest.skip(f"DSE paper text not found at {DSE_TXT}")
    df = pdata.load_table("dse_paper/table2")
    assert list(df.columns) == pdata.COLUMNS and not df.duplicated(["variant", "column"]).any()
    lines = DSE_TXT.read_text(encoding="utf-8").splitlines()
    cap = next(i for i, ln in enumerate(lines) if ln.startswith("Table 2: Long-context"))
    printed = {ln.split("\t")[0]: _numbers(re.sub(r"</?[bu]>", "", " ".join(ln.split("\t")[1:])))
               for ln in lines[:cap] if ln.startswith(("MoE-27B (", "DSE-27B ("))}
    order = ["longppl_book", "longppl_paper", "longppl_code", "longppl_lcot", "ruler_s", "ruler_mk", "ruler_mv",
             "ruler_mq", "ruler_vt", "ruler_cwe", "ruler_fwe", "ruler_qa"]
    assert len(printed) == 4
    for row, g in df.groupby("row", sort=False):
        assert g.set_index("column")["value"][order].tolist() == printed[row], row
        assert all(DSE_SRC.match(s) and f"row '{row}'" in s for s in g["source"])
