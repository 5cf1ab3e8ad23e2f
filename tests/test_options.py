"""Each option list is defined once (stem/options.py); the config's typed tree types its fields with them."""
import dataclasses
import json
import typing
from enum import StrEnum

import pytest

from stem import config as C
from stem.config import experiment as E
from stem.options import (Device, DocKeys, DSEMode, Experiment, RopeKind, RopeRamp, Scale, Schedule, Stage, Strategy,
                          TableInit, TableLayout, TableUpdate, values)


def _option_fields(cls, seen=None):
    """{(node, field): the option lists (StrEnums) its type names}, over the whole tree below ``cls``."""
    seen = {} if seen is None else seen
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        stack = [tp]
        while stack:
            t = stack.pop()
            if isinstance(t, type) and issubclass(t, StrEnum):
                seen.setdefault((cls.__name__, f.name), set()).add(t)
            elif dataclasses.is_dataclass(t) and t.__name__ not in {c for c, _ in seen} | {cls.__name__}:
                _option_fields(t, seen)
            stack += typing.get_args(t)
    return seen


def test_the_tree_is_typed_with_the_option_lists():
    found = _option_fields(E.Experiment)
    expected = {("Experiment", "experiment"): Experiment, ("Experiment", "archs"): Scale,
                ("Experiment", "stages"): Stage,
                ("Experiment", "device"): Device, ("Cluster", "parallel"): Strategy, ("Cluster", "tables"): TableLayout,
                ("StageSettings", "schedule"): Schedule, ("OptimSpec", "table_update"): TableUpdate,
                ("Arch", "table_init"): TableInit, ("RopeScaling", "kind"): RopeKind, ("RopeScaling", "ramp"): RopeRamp,
                ("Source", "doc_keys"): DocKeys, ("DSEDisabled", "modes"): DSEMode}
    for key, option in expected.items():
        assert option in found.get(key, ()), key
    # a value outside the list is refused naming the list, as written once in options.py
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["stages"]["pretrain"]["350m"]["rope_scaling"] = {"kind": "ntk"}
    with pytest.raises(C.ConfigError) as e:
        E.parse(cfg, "tiny.yaml")
    assert str(e.value) == (f"tiny.yaml: key 'stages.pretrain.350m.rope_scaling.kind': 'ntk'; expected one of "
                            f"{', '.join(values(RopeKind))}")


def test_options_are_their_strings():
    """A member compares, hashes and serialises as its string, so specs written before stay byte-identical."""
    assert Strategy.FSDP == "fsdp" and {"fsdp": 1}[Strategy.FSDP] == 1
    assert json.dumps({"parallel": Strategy.DDP}) == '{"parallel": "ddp"}'
    assert C.SCALES == ("350m", "1b") and C.STAGES == ("pretrain", "midtrain", "extend")
