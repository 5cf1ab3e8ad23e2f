"""The offline install of a GPU node with its own PyTorch (issue 31): `make wheelhouse WHAT=gpucheck` here
(the registry reachable), leaving out what the node's environment has (a pip freeze of it), then
`make gpu-check TORCH=system WHEELHOUSE=...` into a fresh venv with pip's index unreachable, and the acceptance
run at tiny shapes in it. The node's PyTorch is torch and its requirements alone, on PYTHONPATH (as a module
system provides it); nothing else of this environment is visible to the venv. Nothing is cached between runs
(pip's own HTTP cache speeds the download, the wheels are checked against their SHA-256 on install)."""
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys

import pytest
from packaging.requirements import Requirement

from stem.config import REPO


def _closure(name: str, seen: dict) -> dict:
    """{name: distribution} of ``name`` and everything it requires here."""
    dist = md.distribution(name)
    key = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
    if key in seen:
        return seen
    seen[key] = dist
    for req in map(Requirement, dist.requires or []):
        if req.marker is None or req.marker.evaluate({"extra": ""}):   # this Python's, no extras
            _closure(req.name, seen)
    return seen


def system_torch(folder):
    """A folder holding this environment's torch and its requirements (links), as a node's own PyTorch."""
    folder.mkdir()
    for dist in _closure("torch", {}).values():
        site = dist.locate_file("")
        for top in {f.parts[0] for f in dist.files if not f.parts[0].startswith("..")}:
            if not (folder / top).exists():
                (folder / top).symlink_to(site / top)
    return folder


@pytest.mark.waits   # its wheelhouse download waits on the registry: make test runs it beside the rest
def test_offline_gpucheck_install_on_system_torch(tmp_path):
    system = system_torch(tmp_path / "system")
    freeze = tmp_path / "freeze.txt"
    freeze.write_text(subprocess.run([sys.executable, "-m", "pip", "freeze", "--path", str(system)], check=True,
                                     capture_output=True, text=True).stdout)
    wheels, venv, out = tmp_path / "wheels", tmp_path / "venv", tmp_path / "out"
    # an outer make's flags and variables (make test X=...) stay out of these makes
    clean = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    pyver = "%d.%d" % sys.version_info[:2]
    subprocess.run(["make", "-s", "-C", str(REPO), "wheelhouse", f"WHEELHOUSE={wheels}", "WHAT=gpucheck",
                    f"WHEEL_PYTHON={pyver}", f"WHEEL_PLATFORM=manylinux_2_28_{platform.machine()}",
                    f"LEAVE_OUT={freeze}", f"PYTHON={sys.executable}"], env=clean, check=True)
    manifest = json.loads((wheels / "manifest.json").read_text())
    names = {w["name"] for w in manifest["wheels"]}
    assert {"lm_eval", "numpy", "tokenizers", "safetensors", "PyYAML"} <= names and "torch" not in names
    assert {"sympy", "filelock", "Jinja2"} <= set(manifest["left_out"]) and not names & set(manifest["left_out"])
    assert manifest["python"] == pyver and all(len(w["sha256"]) == 64 for w in manifest["wheels"])
    # the venv: no system site-packages here (this machine's base Python holds unrelated packages), so the
    # node's PyTorch comes from PYTHONPATH alone; pip's configuration is off and its index unreachable
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in clean.items() if not k.startswith(("PIP_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONPATH=str(system), PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL="http://127.0.0.1:9/simple")
    r = subprocess.run(["make", "-s", "-C", str(REPO), "gpu-check", f"VENV={venv}", "TORCH=system",
                        f"WHEELHOUSE={wheels}", f"GPUCHECK_ARGS=--tiny --device cpu --items ge --no-compile "
                        f"--peak-tflops 1 --require-mfu 0.5 --budget 600 --out {out}"],
                       env=env, capture_output=True, text=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    assert not list(site.glob("torch*")) and list(site.glob("lm_eval*")), r.stdout + r.stderr
    # e: every point ran, but the required MFU (50 % of a 1-TFLOPS "peak") is missed: the run fails on it alone
    report = json.loads((out / "gpucheck.json").read_text())
    assert list(report["items"]) == ["e", "g"] and report["finished"], r.stdout + r.stderr
    assert report["items"]["g"]["ok"] and not report["items"]["e"]["ok"], r.stdout + r.stderr
    assert "NOT met (required: --require-mfu)" in report["items"]["e"]["figure"]
    assert r.returncode != 0 and "gpucheck: 1/2 passed on cpu" in r.stdout and "failed: e" in r.stdout


def _script_module(name: str):
    """scripts/NAME.py as a module (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _wheelhouse(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "scripts" / "wheelhouse.py"), *args], capture_output=True,
                          text=True, timeout=60)


def test_wheelhouse_inputs_are_checked_before_any_download_and_leftovers_removed(tmp_path):
    """Issue 43 items 4 and 6 (no network: each run stops before pip): a nonsense WHEEL_PLATFORM and a LEAVE_OUT
    that does not exist are refused in one line naming them; an interrupted run's temporary folder beside the
    output is removed by the next run, and only a folder the script made (its marker file)."""
    out = tmp_path / "wh"
    r = _wheelhouse("--out", str(out), "--platform", "nonsense_x86")
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        "wheelhouse: --platform (WHEEL_PLATFORM) 'nonsense_x86': not a platform tag; expected manylinux_2_N_ARCH "
        "(or manylinux2014_ARCH), musllinux_1_N_ARCH, macosx_X_Y_ARCH, win32, win_amd64 or win_arm64 (ARCH e.g. "
        "x86_64, aarch64)"]
    r = _wheelhouse("--out", str(out), "--leave-out", str(tmp_path / "freeze.txt"))
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"wheelhouse: --leave-out (LEAVE_OUT) {tmp_path / 'freeze.txt'}: no such file (expected a pip freeze of "
        "the target environment)"]
    # an interrupted run's temporary folder, made as the script makes it, and look-alikes it did not make (no
    # marker; a marker naming another output; the name before the tmp- prefix): only the first is removed
    wheelhouse = _script_module("wheelhouse")
    left = wheelhouse.make_tmp(out.resolve())
    alike = {".wh.tmp-k2j4_x9a": None, ".wh.tmp-3kq0_7zb": "elsewhere\n", ".wh.k2j4_x9a": None}
    for folder, marker in [(left, None), *((tmp_path / name, m) for name, m in alike.items())]:
        (folder / "dl").mkdir(parents=True)
        (folder / "dl" / "numpy-2.0.whl").write_bytes(b"partial")
        if marker:
            (folder / wheelhouse.MARKER).write_text(marker)
    (tmp_path / "bad.txt").write_text("numpy>=1\n")   # stops at the constraints, before pip
    r = _wheelhouse("--out", str(out), "--constraints", str(tmp_path / "bad.txt"))
    assert r.returncode == 1 and "is not a 'name==version' pin" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["bad.txt", *alike])
