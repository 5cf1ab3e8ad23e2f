"""``make wheelhouse``: a folder of wheels for an install without the package registry (docs/gpu.md).

    python3 scripts/wheelhouse.py --out DIR [--what all|gpucheck] [--python 3.12]
                                  [--platform manylinux_2_28_x86_64] [--leave-out FREEZE]

Every package pinned in constraints.txt (``all``; plus setuptools, the build backend of the project's
editable install) or only what ``python -m stem gpucheck`` imports (``gpucheck``:
scripts/gpucheck-requirements.txt), at the pinned versions, for one Python version and platform; never
torch (the node's own, TORCH=system, or a wheel of it put beside them). ``--leave-out`` takes a
``pip freeze`` of the environment the wheels go to: the packages it lists are left out (the environment's
versions are used; the manifest names them). Where the registry has no wheel for the platform, the sdist
is built into a wheel here, which must then be pure Python. The folder gets the wheels,
``requirements.txt`` (``name==version --hash=sha256:...``: pip checks every wheel's hash on install) and
``manifest.json`` (Python, platforms, every wheel's name, version, file, bytes and SHA-256, what was left
out). Written to a temporary folder (``.OUT.tmp-*``, holding a marker file written first) and moved into place
at the end; an interrupted run's temporary folder is removed by the next run (only a folder with the marker).
Standard library only: it runs before any venv exists.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GPUCHECK = REPO / "scripts" / "gpucheck-requirements.txt"
# Not in constraints.txt (pip freeze leaves it out): the build backend of `pip install -e .` (pyproject.toml)
# and a requirement of torch; the version of the pinned environment
EXTRA = {"setuptools": "84.0.0"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#]+)\s*$")


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, tuple[str, str]]:
    """{canonical name: (name, version)} of a constraints file of ``name==version`` lines."""
    pins = {}
    for i, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = PIN.match(line)
        if not m:
            raise SystemExit(f"wheelhouse: {path}:{i}: {line!r} is not a 'name==version' pin")
        pins[canon(m[1])] = (m[1], m[2])
    return pins


def read_names(path: Path) -> list[str]:
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def read_freeze(path: Path) -> dict[str, str]:
    """{canonical name: line} of a ``pip freeze`` file (``name==v``, ``name @ url``; ``-e`` lines skipped)."""
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-")):
            continue
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if not m:
            raise SystemExit(f"wheelhouse: {path}: {line!r} is not a pip freeze line")
        out[canon(m[1])] = line
    return out


def platforms(platform: str) -> list[str]:
    """pip matches --platform exactly: manylinux_2_N_ARCH stands for every manylinux tag of glibc <= 2.N."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    glibc, arch = int(m[1]), m[2]
    tags = [f"manylinux_2_{n}_{arch}" for n in range(glibc, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}
    return tags + [f"{name}_{arch}" for n, name in legacy.items() if n <= glibc]


ARCH = r"(x86_64|i686|aarch64|armv7l|ppc64le|ppc64|s390x|riscv64)"
PLATFORM = re.compile(rf"manylinux_2_\d+_{ARCH}|manylinux(1|2010|2014)_{ARCH}|musllinux_1_\d+_{ARCH}"
                      r"|macosx_\d+_\d+_(x86_64|arm64|universal2|universal|intel|fat64|fat32|fat|i386|ppc64|ppc)"
                      r"|win32|win_amd64|win_arm64")


def check_inputs(args):
    """One line for a platform tag outside the manylinux/musllinux/macosx/win grammar (pip would only say it
    finds no distribution) or a --leave-out file that does not exist: before anything is downloaded."""
    if not PLATFORM.fullmatch(args.platform):
        raise SystemExit(f"wheelhouse: --platform (WHEEL_PLATFORM) {args.platform!r}: not a platform tag; expected "
                         "manylinux_2_N_ARCH (or manylinux2014_ARCH), musllinux_1_N_ARCH, macosx_X_Y_ARCH, "
                         "win32, win_amd64 or win_arm64 (ARCH e.g. x86_64, aarch64)")
    if args.leave_out and not Path(args.leave_out).is_file():
        raise SystemExit(f"wheelhouse: --leave-out (LEAVE_OUT) {args.leave_out}: no such file (expected a pip "
                         "freeze of the target environment)")


# Written first into every temporary folder of a run (naming the output it is for): the next run removes a folder
# beside the output only when it holds this file, never a look-alike it did not make
MARKER = ".wheelhouse-tmp"


def make_tmp(out: Path) -> Path:
    """A temporary folder beside ``out`` (``.NAME.tmp-*``), marked as this script's before anything else is in it."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    (tmp / MARKER).write_text(f"{out}\n")
    return tmp


def remove_leftovers(out: Path):
    """The temporary folders an interrupted earlier run left beside ``out``: ``.NAME.tmp-*`` holding the marker
    that names ``out``. A folder named alike without it is left alone (not made here, or killed between its
    creation and the marker's write: then empty)."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        marker = stale / MARKER
        if stale.is_dir() and not stale.is_symlink() and marker.is_file() and marker.read_text() == f"{out}\n":
            shutil.rmtree(stale, ignore_errors=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pip(*args: str):
    r = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True)
    if r.returncode:
        lines = [ln for ln in (r.stderr + r.stdout).splitlines() if ln.strip()]
        raise SystemExit(f"wheelhouse: pip {args[0]} failed: {lines[-1] if lines else r.returncode}")


def wanted(what: str, pins: dict, constraints: Path) -> dict[str, tuple[str, str]]:
    if what == "all":
        chosen = dict(pins)
    else:
        chosen = {}
        for name in read_names(GPUCHECK):
            if canon(name) not in pins:
                raise SystemExit(f"wheelhouse: {GPUCHECK.name}: {name} has no pin in {constraints}")
            chosen[canon(name)] = pins[canon(name)]
    chosen.pop("torch", None)
    chosen.update({canon(n): (n, v) for n, v in EXTRA.items()})
    return chosen


def build(args) -> dict:
    out = Path(args.out).resolve()
    if out.parent.is_dir():
        remove_leftovers(out)
    constraints = Path(args.constraints)
    chosen = wanted(args.what, read_pins(constraints), constraints)
    left_out = {}
    if args.leave_out:
        freeze = read_freeze(Path(args.leave_out))
        left_out = {chosen[k][0]: freeze[k] for k in sorted(chosen) if k in freeze}
        chosen = {k: v for k, v in chosen.items() if k not in freeze}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = make_tmp(out)
    try:
        reqs = tmp / "wanted.txt"
        reqs.write_text("".join(f"{n}=={v}\n" for n, v in chosen.values()))
        tags = platforms(args.platform)
        pyver = args.python.replace(".", "")
        # --no-deps: the list is the whole set; an sdist is allowed where no wheel fits (built below)
        pip("download", "--quiet", "--no-deps", "--dest", str(tmp / "dl"), "--python-version", args.python,
            "--implementation", "cp", "--abi", f"cp{pyver}", "--abi", "abi3", "--abi", "none",
            *[a for t in tags for a in ("--platform", t)], "-r", str(reqs))
        wheels = tmp / "wheels"
        wheels.mkdir()
        for f in sorted((tmp / "dl").iterdir()):
            if f.suffix == ".whl":
                f.rename(wheels / f.name)
                continue
            pip("wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp / "built"), str(f))
            for w in (tmp / "built").glob("*.whl"):
                if not w.name.endswith("-none-any.whl"):
                    raise SystemExit(f"wheelhouse: {f.name}: no wheel for cp{pyver} {args.platform} on the registry, "
                                     f"and it builds a platform wheel here ({w.name}): build it on the target")
                w.rename(wheels / w.name)
        rows = []
        for w in sorted(wheels.iterdir()):
            dist, version = w.name.split("-")[:2]
            name, pinned = chosen.get(canon(dist), (dist, None))
            if pinned is None or canon(version) != canon(pinned):
                raise SystemExit(f"wheelhouse: {w.name}: expected {name}=={pinned} (constraints)")
            rows.append({"name": name, "version": pinned, "file": w.name, "bytes": w.stat().st_size,
                         "sha256": sha256(w)})
        missing = sorted({v[0] for v in chosen.values()} - {r["name"] for r in rows})
        if missing:
            raise SystemExit(f"wheelhouse: no wheel for {', '.join(missing)}")
        (wheels / "requirements.txt").write_text(
            "".join(f"{r['name']}=={r['version']} --hash=sha256:{r['sha256']}\n" for r in rows))
        manifest = {"what": args.what, "python": args.python, "implementation": "cp", "platform": args.platform,
                    "platform_tags": tags, "constraints": str(constraints), "left_out": left_out,
                    "wheels": rows, "total_bytes": sum(r["bytes"] for r in rows)}
        (wheels / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        wheels.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the folder to write (replaced when it exists)")
    p.add_argument("--what", choices=["all", "gpucheck"], default="all")
    p.add_argument("--python", default="3.12", help="the target's Python version (default 3.12)")
    p.add_argument("--platform", default="manylinux_2_28_x86_64",
                   help="the target's platform; manylinux_2_N_ARCH: glibc 2.N or newer (default manylinux_2_28_x86_64)")
    p.add_argument("--constraints", default=str(REPO / "constraints.txt"))
    p.add_argument("--leave-out", help="a pip freeze of the target environment: its packages are left out")
    args = p.parse_args(argv)
    if not re.fullmatch(r"3\.\d+", args.python):
        raise SystemExit(f"wheelhouse: --python {args.python}: expected a version like 3.12")
    check_inputs(args)
    m = build(args)
    print(f"wheelhouse: {len(m['wheels'])} wheels, {m['total_bytes'] / 2**20:.1f} MiB, for CPython {args.python} "
          f"{args.platform} ({args.what}" + (f", {len(m['left_out'])} left out" if m["left_out"] else "")
          + f") -> {Path(args.out).resolve()}")


if __name__ == "__main__":
    main()
