# Two commands do everything:  make train  (the main job)   make test  (the test suite)
PY ?= python3
# where make train keeps main.log and its checkpoints (then: python sample_gpt2.py -o out)
OUT ?= out
PIP ?= $(PY) -m pip
# make bench PRECISION=bf16: our bf16 step and torch.compile's bf16-autocast step
PRECISION ?= fp32

.PHONY: setup setup-test data train sample test gpu-test lab bench energy profile trace clean

setup:            ## runtime dependencies, llmc itself (editable: dev/ scripts import it); with a GPU also PyCUDA
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps -e .
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && ! $(PY) -c "import pycuda" 2>/dev/null; then \
		echo "GPU found: installing PyCUDA (builds from source if no wheel fits; needs nvcc)"; \
		$(PIP) install -q pycuda cuda-python; fi

setup-test: setup
	$(PIP) install -q -r requirements-test.txt

data: setup       ## tokenize tiny shakespeare into dev/data/tinyshakespeare/*.bin (skips if present)
	$(PY) prepro_tinyshakespeare.py

train: data       ## GPT-2 124M on the GPU; without one, a small model on the numpy backend; checkpoints in $(OUT)/
	$(PY) train_gpt2.py -o $(OUT)

sample:           ## text from the newest checkpoint that make train wrote
	$(PY) sample_gpt2.py -o $(OUT) --prompt "ROMEO:" --max-new-tokens 100

test: setup-test  ## the CI suite (no GPU needed)
	$(PY) -m pytest -q

gpu-test:         ## on a GPU machine: every kernel variant, the model on cuda vs cpu
	$(PY) -m pytest -m gpu -q

lab:              ## on a GPU machine: the whole kernel lab -> docs/lab/
	$(PY) dev/cuda/run_all.py

bench:            ## on a GPU machine: d12 training step at B=4 and B=16, T=1024, with torch.compile's beside it (PRECISION=fp32|bf16)
	$(PY) dev/bench_step.py -b 4 --precision $(PRECISION) --power
	$(PY) dev/bench_step.py -b 16 --precision $(PRECISION) --power
	$(PY) dev/bench_torch.py -b 4 16 --precision $(PRECISION)

energy:           ## on a GPU machine: the bf16 step's GEMMs and cuBLAS's, ms and joules a call under a sustained load, every plan
	$(PY) dev/bench_energy.py --plans

profile:          ## on a GPU machine: per-kernel profile of one d12 training step
	$(PY) dev/profile_step.py

trace:            ## on a GPU machine: the kernel timeline of whole d12 steps as the GPU ran them (CUPTI via torch.profiler)
	$(PY) dev/trace_step.py -b 4 --precision $(PRECISION)
	$(PY) dev/trace_step.py -b 16 --precision $(PRECISION)

clean:
	rm -rf out .pytest_cache
