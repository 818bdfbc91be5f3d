#!/usr/bin/env bash
# GPU tests and benchmarks in one command, for the lent H200 (no network).
#
#   OUT=/some/dir bash scripts/device_bench.sh          # from the repository root
#
# A snapshot exported with `git archive` should carry its commit in a COMMIT file (the
# results record it): git archive HEAD | tar -x -C DIR && git rev-parse --short HEAD > DIR/COMMIT
#
# Uses the machine's python3 and torch. Python packages the machine lacks (gguf, pyyaml,
# jinja2, tqdm, pytest, ...) are installed from wheels in .whl/ when that folder was
# carried along; the package itself runs from the source tree (PYTHONPATH).
# Every stage is time-boxed; a stage that fails or times out is recorded in bench.json
# and the next one runs. The whole run stays under BUDGET_S seconds (default 530).
# TEST_WORKERS=N runs the GPU tests in N processes (default 8; pytest-xdist wheels in .whl/).
# Kernel switches (LODESTAR_FUSE, LODESTAR_PDL, LODESTAR_GEMV_TABLE, ...; lodestar/kernels/policy.py)
# reach every stage through the environment. What some stages compare is set by these variables
# of this script, passed on as options of python -m lodestar.bench.gpu (see its --help):
#   LODESTAR_SWEEP_CONTEXTS -> sweep --contexts     LODESTAR_SWEEP_QTYPES -> sweep --qtypes
#   LODESTAR_CHAIN_CELLS -> chain --chain-cells     LODESTAR_FUSE_CELLS -> fuse --fuse-cells
#   LODESTAR_FUSE_ON / _OFF -> fuse --fuse-on / --fuse-off
#   LODESTAR_GEMV_AB -> gemvform --gemv-ab (off, a table file, or one tiling; no longer a variant name)
#   LODESTAR_AB -> ab --ab (set but empty: one side, the settings in force)
#   LODESTAR_AB_CELLS -> ab --ab-cells              LODESTAR_PREFILL_ATTN_CASES -> prefillattn --prefill-attn-cases
# Writes under $OUT: pytest.xml (GPU tests), pytest-tp.xml (two-GPU tests), bench.json (all measurements, errors and
# stage exit codes), sweep.csv + sweep.svg (decode speed against context), gemv-variants.json
# (matrix-vector tilings and loop forms per 8B shape), dense-variants.json (the same for the dense
# bf16 kernel), log.txt.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT to the results folder}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
BUDGET=${BUDGET_S:-530}
START=$(date +%s)
LOG="$OUT/log.txt"
JSON="$OUT/bench.json"
DEPS=/tmp/lodestar-pydeps          # wheels from .whl/ are unpacked here, not into the system
export PYTHONPATH="$PWD:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off on shared multi-GPU hosts (NCCL, PyTorch symmetric memory, NVSHMEM).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
: > "$LOG"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }
say() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$LOG"; }
note() {  # append a line to bench.json's "runner" list (no torch import: it costs seconds)
  $PY -c 'import json, os, sys
p, msg = sys.argv[1], sys.argv[2]
doc = json.load(open(p)) if os.path.isfile(p) else {}
doc.setdefault("runner", []).append(msg)
json.dump(doc, open(p + ".tmp", "w"), indent=1)
os.replace(p + ".tmp", p)' "$JSON" "$*" >> "$LOG" 2>&1 || true
}

# _stage NAME CAP_SECONDS COMMAND...: runs COMMAND for at most min(CAP, time left - 15 s)
_stage() {
  local name=$1 cap=$2; shift 2
  local l; l=$(left)
  local t=$(( cap < l - 15 ? cap : l - 15 ))
  if [ "$t" -lt 20 ]; then say "skip $name: ${l}s left"; note "$name: skipped, ${l}s left"; return; fi
  say "stage $name (limit ${t}s)"
  STAGE_SECONDS=$t timeout -k 10 "$t" "$@" >> "$LOG" 2>&1
  local rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then say "$name: timed out after ${t}s"; note "$name: timed out after ${t}s"
  else say "$name: exit $rc"; note "$name: exit $rc after $(( $(date +%s) - START ))s total"; fi
}

bench() { local name=$1 cap=$2; shift 2; want "$name" || return 0; _stage "$name" "$cap" $PY -m lodestar.bench.gpu "$name" --json "$JSON" \
  --seconds "$(( cap < $(left) - 15 ? cap : $(left) - 15 ))" "$@"; }

# -- install: only what is missing, only from carried wheels -------------------------------
say "python: $($PY --version 2>&1); torch: $($PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' 2>&1)"
missing=$($PY - <<'EOF'
import importlib.util
wheels = {"gguf": ["gguf", "pyyaml"], "yaml": ["pyyaml"], "tqdm": ["tqdm"], "jinja2": ["jinja2", "markupsafe"],
          "markupsafe": ["markupsafe"], "pytest": ["pytest", "pluggy", "iniconfig", "packaging"],
          "numpy": ["numpy"], "tokenizers": ["tokenizers"], "safetensors": ["safetensors"],
          "xdist": ["pytest-xdist", "execnet"]}
need = []
for module, names in wheels.items():
    if importlib.util.find_spec(module) is None:
        need += [n for n in names if n not in need]
print(" ".join(need))
EOF
)
if [ -n "$missing" ]; then
  say "missing python packages: $missing"
  if [ -d .whl ]; then
    for pkg in $missing; do
      $PY -m pip install -q --no-index --no-deps --target "$DEPS" --find-links .whl "$pkg" >> "$LOG" 2>&1 \
        && say "installed $pkg from .whl/" || say "no usable wheel for $pkg in .whl/ (see log)"
    done
  else
    say "no .whl/ folder was carried: stages needing those packages will fail"
  fi
fi
$PY -c "import lodestar.engine.llm_engine" >> "$LOG" 2>&1 || say "lodestar does not import (see log)"

# -- stages, most important first -----------------------------------------------------------
# ONLY="tests gemv profile" runs just those stages (names as below).
want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
stage() {
  want "$1" || return 0
  _stage "$@"
}
# The GPU tests are mostly Triton compiling: several minutes in one process on a fresh machine,
# well under the stage's limit in 8 processes (pytest-xdist, carried in .whl/, sharing the GPU
# and the Triton cache). TEST_WORKERS=N sets the processes (default 8 where xdist imports; 1:
# one process, no xdist).
workers=()
nw=${TEST_WORKERS:-8}
if [ "$nw" != 1 ]; then
  if $PY -c "import xdist" 2>/dev/null; then workers=(-n "$nw"); else say "TEST_WORKERS=$nw: no pytest-xdist, one process"; fi
fi
stage tests 480 $PY -m pytest -q -p no:cacheprovider -o addopts="" ${workers[@]+"${workers[@]}"} --junitxml="$OUT/pytest.xml" \
  tests/kernels/test_triton_quant.py tests/kernels/test_triton_attention.py tests/kernels/test_triton_fused.py \
  tests/kernels/test_triton_decode_fusion.py tests/kernels/test_triton_dense.py \
  tests/kernels/test_triton_dense_fusion.py tests/kernels/test_triton_sampling.py \
  tests/kernels/test_quant_stack.py tests/engine/test_cuda_exactness.py tests/formats/test_safetensors.py
# Two or more GPUs: tensor parallelism over NCCL (skipped with one GPU).
stage tptests 150 $PY -m pytest -q -s -p no:cacheprovider -o addopts="" -o faulthandler_timeout=100 \
  --junitxml="$OUT/pytest-tp.xml" \
  tests/distributed/test_tensor_parallel_cuda.py
bench env 25
bench overlap 120
bench profile 75
bench small 30
bench 8b-f16 70
bench 8b-q4_0 40
bench 8b-q4k 40
bench 8b-q4km 40
bench prefill 45
bench sweep 60 --csv "$OUT/sweep.csv" --svg "$OUT/sweep.svg" ${LODESTAR_SWEEP_CONTEXTS:+--contexts "$LODESTAR_SWEEP_CONTEXTS"} \
  ${LODESTAR_SWEEP_QTYPES:+--qtypes "$LODESTAR_SWEEP_QTYPES"}
bench fuse 90 ${LODESTAR_FUSE_CELLS:+--fuse-cells "$LODESTAR_FUSE_CELLS"} ${LODESTAR_FUSE_ON:+--fuse-on "$LODESTAR_FUSE_ON"} \
  ${LODESTAR_FUSE_OFF:+--fuse-off "$LODESTAR_FUSE_OFF"}
bench gemvform 150 ${LODESTAR_GEMV_AB:+--gemv-ab "$LODESTAR_GEMV_AB"}
bench ab 200 ${LODESTAR_AB+--ab "$LODESTAR_AB"} ${LODESTAR_AB_CELLS:+--ab-cells "$LODESTAR_AB_CELLS"}
bench hostprof 60
bench prefillgraph 150
bench prefillattn 150 ${LODESTAR_PREFILL_ATTN_CASES:+--prefill-attn-cases "$LODESTAR_PREFILL_ATTN_CASES"}
bench chain 120 ${LODESTAR_CHAIN_CELLS:+--chain-cells "$LODESTAR_CHAIN_CELLS"}
stage gemvvar 170 bash -c "$PY -m lodestar.bench.gemv_variants --budget \${GEMVVAR_BUDGET:-90} \${GEMVVAR_ONLY:+--only \$GEMVVAR_ONLY} \${GEMVVAR_QTYPES:+--qtypes \$GEMVVAR_QTYPES} > '$OUT/gemv-variants.json'"
stage densevar 200 bash -c "$PY -m lodestar.bench.gemv_variants --dense --budget \${DENSEVAR_BUDGET:-120} > '$OUT/dense-variants.json'"
bench densegemv 100
bench tp 150
bench tp70 120
bench gemv 100
bench dense 90
bench hf 80 --workdir /tmp/lodestar-bench
# Nsight Compute on single launches of the matrix-vector kernels (Firecracker machines only;
# elsewhere ncu cannot read the counters) and their SASS, from a private Triton cache.
ncu_probe() {  # ncu_probe TAG KERNEL_REGEX PROBE_ARGS...
  local tag=$1 kre=$2; shift 2
  local NCU; NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  [ -n "$NCU" ] || { say "no ncu"; return 1; }
  TRITON_CACHE_DIR=/tmp/tcache-probe timeout 150 "$NCU" --clock-control none --target-processes all \
    -k "regex:$kre" --launch-skip 3 --launch-count 1 --set full --print-details all \
    --print-metric-instances values $PY -m lodestar.bench.kernel_probe "$@" > "$OUT/ncu-$tag.txt" 2>&1
  say "ncu $tag: exit $?"
}
ncu_all() {
  ncu_probe q4_0-gate_up _gemv_kernel quant Q4_0 gate_up
  ncu_probe q4_k-gate_up _gemv_kernel quant Q4_K gate_up
  ncu_probe bf16-gate_up _dense_gemv_kernel dense BF16 gate_up
  mkdir -p "$OUT/sass"
  for f in $(find /tmp/tcache-probe -name "*.cubin" 2>/dev/null); do
    cuobjdump -sass "$f" > "$OUT/sass/$(basename "$(dirname "$f")" | cut -c1-8)-$(basename "$f" .cubin).sass" 2>&1
  done
}
if want ncu; then _stage ncu 400 bash -c "$(declare -f say ncu_probe ncu_all); OUT='$OUT' PY='$PY' START=$START LOG='$LOG' ncu_all"; fi
if want readbw; then _stage readbw 60 bash -c "$PY -m lodestar.bench.kernel_probe readbw > '$OUT/readbw.json'"; fi
if want pattern; then _stage pattern 60 bash -c "$PY -m lodestar.bench.kernel_probe pattern > '$OUT/pattern.json'"; fi
say "done in $(( $(date +%s) - START ))s"
note "done in $(( $(date +%s) - START ))s"
