"""Compiled training (issue 22, item 4): each block torch.compile'd inside activation checkpointing gives the
eager loss and gradients (dense and STEM blocks, tiny shapes, inductor on the CPU); parameter names (hence
checkpoints) do not change; ``train.compile: true`` runs in the training loop, reports its graph breaks and
follows the eager run's loss curve.

Inductor on the CPU compiles C++ kernels: both tests use the tiny training spec's shapes so they share
compiled graphs (~10-20 s together with a warm inductor cache; a first run on a fresh machine takes longer)."""
import copy
import json

import pytest
import torch

from conftest import make_spec
from stem.models.spec import ModelConfig
from stem.models.model import build_model
from stem.train.compile import compile_blocks, describe_breaks, graph_breaks
from stem.train.loop import train

# the arch of conftest.make_spec's STEM spec: STEM in layer 2, dense in 0 and 1
TINY = dict(vocab_size=512, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=48, max_seq_len=256,
            ffn=("dense", "dense", "stem"))


def test_compiled_blocks_match_eager():
    torch.manual_seed(0)
    eager = build_model(ModelConfig(**TINY))
    compiled = copy.deepcopy(eager)
    for m in (eager, compiled):
        m.set_training_options(activation_checkpointing=True)
    compile_blocks(compiled)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    x = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
    losses = []
    for m in (eager, compiled):
        m.train()
        loss = m(x[:, :-1], x[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for (name, pe), pc in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.allclose(pc.grad, pe.grad, rtol=1e-4, atol=1e-6), name


def test_train_compile_in_the_loop(tiny_data, tmp_path, capfd):
    runs = {}
    for mode in ("eager", "compiled"):
        spec = make_spec(tiny_data, tmp_path / mode, steps=3, activation_checkpointing=True,
                         **({"compile": True} if mode == "compiled" else {}))
        assert ("compile" in spec["train"]) is (mode == "compiled")
        train(spec, threads=1)
        runs[mode] = [json.loads(x)["loss"] for x in (tmp_path / mode / "metrics.jsonl").read_text().splitlines()]
    assert runs["compiled"] == pytest.approx(runs["eager"], rel=1e-4)   # step 2 and 3 follow the gradients
    assert "[350m/stem/pretrain] torch.compile: " in capfd.readouterr().err
    assert describe_breaks(graph_breaks()).startswith("torch.compile: ")
