# hpcrl: `make demo` runs the demo, `make test` the tests; each sets up what it needs first.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTEST_ARGS ?=
# two pytest-xdist workers, one per core: the Slurm tests' chain on one (waits for requeues included), the
# rest beside it; tests sharing a world or run stay on one worker (tests/conftest.py `xdist_groups`).
# `make test XDIST=` runs one process.
XDIST ?= -n 2 --dist loadgroup --no-loadscope-reorder

TINY_MODELS := qwen2 qwen3 qwen3-moe phi3

.PHONY: setup lock models data test test-quick demo bench slurm-up slurm-down lint clean distclean \
        smollm2 $(addprefix tiny-,$(TINY_MODELS))

setup:                ## .venv with the pinned CPU stack (idempotent, ~1 s when up to date)
	@bash tools/setup_venv.sh

lock:                 ## requirements/cpu.lock from a fresh resolve of requirements/cpu.txt (after changing it)
	@bash tools/lock_requirements.sh

# one target a model: under `make -j` (make test) they build side by side, SmolLM2's ~27 s beside the rest
models: $(addprefix tiny-,$(TINY_MODELS)) smollm2  ## offline models: tiny random Qwen2, Qwen3, Qwen3-MoE, Phi-3 (tests), SmolLM2-135M-Instruct (demo)

$(addprefix tiny-,$(TINY_MODELS)): tiny-%: setup
	@$(PY) tools/make_tiny_model.py --family $* --out models/tiny-$*

smollm2: setup
	@$(PY) tools/build_smollm2.py --out models/smollm2-135m-instruct --cache models/.cache

data: setup           ## generated data: arithmetic word problems (data/arith), coding tasks (data/code), preference pairs (data/pref)
	@$(PY) tools/make_arith_data.py --out data/arith
	@$(PY) tools/make_code_data.py --out data/code
	@$(PY) tools/make_pref_data.py --out data/pref

slurm-up:             ## local 4-node Slurm cluster (installs Debian packages when missing; needs root)
	@bash tools/slurm_up.sh

slurm-down:           ## stop the local cluster's daemons (by pid file)
	@bash tools/slurm_down.sh

# the cluster's set-up (Debian packages, daemons) needs no venv: it runs beside the pip install
test:                              ## the whole suite, as CI runs it
	@$(MAKE) --no-print-directory -j3 setup models data slurm-up
	$(PY) -m pytest tests $(XDIST) $(PYTEST_ARGS)

test-quick: setup models data      ## the inner loop: every test that starts no world, `hpcrl run` or Slurm job
	HPCRL_TEST_QUICK=1 $(PY) -m pytest tests -m "not world" $(XDIST) $(PYTEST_ARGS)

demo: setup models data            ## GRPO demo on SmolLM2-135M-Instruct (see README)
	@bash tools/demo.sh $(ARGS)

bench: setup models data           ## benchmarks (not run by CI); each prints ratios side by side
	@bash tools/bench.sh

lint: setup
	$(VENV)/bin/ruff check hpcrl launchers tools tests

clean:                ## run outputs and caches (keeps .venv, models and data)
	rm -rf runs .pytest_cache .ruff_cache
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +

distclean: clean      ## also .venv, models and data
	rm -rf $(VENV) models data
