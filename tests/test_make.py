"""The Makefile's install step: the CPU build of torch comes from PyTorch's CPU wheel index, not PyPI's
default (CUDA) build, and the index can be overridden (make -n prints the commands, runs nothing)."""
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _install_commands(tmp_path, *args):
    venv = tmp_path / "venv"   # never built: -n only prints, -B prints even though nothing is out of date
    r = subprocess.run(["make", "-n", "-B", f"VENV={venv}", *args, f"{venv}/.installed-stamp"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_cpu_torch_comes_from_the_cpu_wheel_index(tmp_path):
    out = _install_commands(tmp_path)
    no_driver = out.split("else ", 1)[1]   # the branch taken where `nvidia-smi` is missing
    assert "pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu;" in no_driver


def test_torch_index_can_be_overridden(tmp_path):
    out = _install_commands(tmp_path, "TORCH_INDEX=https://mirror.example/whl/cpu")
    assert "torch==2.13.0 --index-url https://mirror.example/whl/cpu;" in out
    assert "download.pytorch.org" not in out
