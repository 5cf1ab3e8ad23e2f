"""Each option list is defined once (stem/options.py); the schema's enums repeat it and must agree."""
import json

from stem import config as C
from stem.io import read_yaml
from stem.options import Experiment, Scale, Schedule, Stage, Strategy, TableInit, TableLayout, TableUpdate, values


def _enums(node, path=()):
    """Every ``enum`` of the schema, by the path of keys that leads to it."""
    if isinstance(node, dict):
        if "enum" in node:
            yield path, node["enum"]
        for k, v in node.items():
            yield from _enums(v, path + (k,))


def test_schema_enums_are_the_option_lists():
    schema = read_yaml(C.SCHEMA)
    found = {}
    for path, enum in _enums(schema):
        found.setdefault(path[-1], []).append(enum)
    expected = {"experiment": Experiment, "scale_name": Scale, "stage_name": Stage, "strategy": Strategy, "schedule": Schedule,
                "table_update": TableUpdate, "table_init": TableInit, "tables": TableLayout}
    for key, option in expected.items():
        assert found.get(key), f"schema has no enum under {key!r}"
        for enum in found[key]:
            assert [str(v) for v in enum] == list(values(option)), (key, enum)


def test_options_are_their_strings():
    """A member compares, hashes and serialises as its string, so specs written before stay byte-identical."""
    assert Strategy.FSDP == "fsdp" and {"fsdp": 1}[Strategy.FSDP] == 1
    assert json.dumps({"parallel": Strategy.DDP}) == '{"parallel": "ddp"}'
    assert C.SCALES == ("350m", "1b") and C.STAGES == ("pretrain", "midtrain", "extend")
