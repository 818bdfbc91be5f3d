#!/usr/bin/env bash
# Runs on the lent GPU, each under the device's 10-minute limit per call:
#
#   OUT=DIR bash scripts/device_ab.sh tests    # GPU tests of this tree -> $OUT/pytest.xml
#   OUT=DIR bash scripts/device_ab.sh ab       # this tree against .ab/base -> $OUT/ab.json
#   OUT=DIR bash scripts/device_ab.sh goldens  # the real default model's GPU tests (its package
#                                              # carried as .model/smol.tar.part00 + part01)
#   OUT=DIR bash scripts/device_ab.sh structured  # structured output: GPU tests and the bench on
#                                              # the default model (both halves carried) and
#                                              # synthetic 8B -> $OUT/structured-*.json
#   OUT=DIR bash scripts/device_ab.sh spec-curve  # a verify step of k = 1..8 rows against one decode
#                                              # row, synthetic 8B F16 / Q4_0 / Q4_K_M, context 512
#                                              # -> $OUT/spec-curve-8b-*.json
#   OUT=DIR bash scripts/device_ab.sh spec     # speculative decoding: GPU tests and `lodestar bench
#                                              # spec` on the default model (both halves carried)
#                                              # -> $OUT/spec-*.json
#
# .ab/base holds the baseline's lodestar/ (git archive BASE lodestar | tar -x -C .ab/base);
# .whl/ holds wheels of what the machine lacks (gguf, pytest, ...). Both are git-ignored and
# carried along. Uses the machine's python3 and torch.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
DEPS=/tmp/lodestar-pydeps
export PYTHONPATH="$DEPS" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
for pkg in gguf yaml:pyyaml tqdm jinja2 markupsafe pytest:pytest,pluggy,iniconfig,packaging xdist:pytest-xdist,execnet \
           llguidance jsonschema:jsonschema,attrs,referencing,rpds-py,jsonschema-specifications; do
  mod=${pkg%%:*}; names=${pkg#*:}; [ "$names" = "$pkg" ] && names=$mod
  $PY -c "import $mod" 2>/dev/null && continue
  for n in ${names//,/ }; do
    $PY -m pip install -q --no-index --no-deps --target "$DEPS" --find-links .whl "$n" >> "$OUT/install.log" 2>&1 || echo "no wheel for $n"
  done
done
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
# the compiled CPU kernels, for this machine's Python (the CPU tests then run them, as CI does)
$PY setup.py -q build_ext --inplace >> "$OUT/install.log" 2>&1 || echo "native CPU kernels not built (see install.log)"
case "${1:-}" in
  tests)
    PYTHONPATH="$PWD:$DEPS" timeout -k 10 ${TESTS_S:-540} $PY -m pytest -q -p no:cacheprovider -o addopts="" -n 8 \
      --junitxml="$OUT/pytest.xml" tests/kernels tests/engine/test_cuda_exactness.py tests/engine/test_overlap.py \
      tests/formats/test_safetensors.py tests/models tests/layers 2>&1 | tail -60 | tee "$OUT/pytest.txt" ;;
  ab)
    $PY scripts/ab_trees.py --tree base=.ab/base --tree head=. --rounds ${ROUNDS:-3} --budget ${AB_S:-550} \
      --json "$OUT/ab.json" 2>&1 | tee "$OUT/ab.txt" | tail -80 ;;
  goldens)
    # the default model's package, carried in two halves over two calls (.model/smol.tar.part00, 01)
    cat .model/smol.tar.part00 .model/smol.tar.part01 | tar -x -C "$DEPS" || { echo "model halves missing"; exit 3; }
    PYTHONPATH="$PWD:$DEPS" timeout -k 10 ${TESTS_S:-300} $PY -m pytest -q -p no:cacheprovider -o addopts="" -n 8 \
      --junitxml="$OUT/pytest-goldens.xml" tests/engine/test_cuda_exactness.py tests/engine/test_overlap.py \
      tests/models tests/layers/test_linear.py tests/kernels/test_dequant.py 2>&1 | tail -30 | tee "$OUT/pytest-goldens.txt" ;;
  structured)
    # structured output: GPU tests on the default model, every part of `lodestar bench structured`
    # on it, and the cost part on synthetic 8B (F16, Q4_K_M) for the mask path at real step times
    cat .model/smol.tar.part00 .model/smol.tar.part01 | tar -x -C "$DEPS" || { echo "model halves missing"; exit 3; }
    PYTHONPATH="$PWD:$DEPS" timeout -k 10 180 $PY -m pytest -q -p no:cacheprovider -o addopts="" -n 4 \
      --junitxml="$OUT/pytest-structured.xml" tests/engine/test_grammar_cuda.py tests/engine/test_cuda_exactness.py \
      tests/engine/test_overlap.py tests/engine/test_sampling.py 2>&1 | tail -20 | tee "$OUT/pytest-structured.txt"
    PYTHONPATH="$PWD:$DEPS" timeout -k 10 200 $PY -m lodestar.cli bench structured --device cuda \
      --cost-tokens 256 --runs 5 --out "$OUT/structured-smollm2.json" 2>&1 | tail -40 | tee "$OUT/structured.txt"
    for m in synthetic:llama-3.1-8b:F16 synthetic:llama-3.1-8b:Q4_K_M; do
      PYTHONPATH="$PWD:$DEPS" timeout -k 10 150 $PY -m lodestar.cli bench structured --device cuda \
        --model "$m" --parts cost --cost-tokens 256 --runs 5 --out "$OUT/structured-8b-${m##*:}.json" 2>&1 \
        | tail -8 | tee -a "$OUT/structured.txt"
    done ;;
  spec-curve)
    # python -m lodestar.bench.spec_curve per model, each in its own process: ~20 s to make the
    # weights, kernels compiled and the decode graphs of buckets 1, 2, 4, 8 captured, then
    # 8 ks x (3 + 5 runs x 10 steps) timed steps of a few ms; SPEC_S bounds each model
    for t in f16 q4_0 q4_k_m; do
      PYTHONPATH="$PWD:$DEPS" timeout -k 10 ${SPEC_S:-110} $PY -m lodestar.bench.spec_curve --device cuda \
        --model llama-3.1-8b --dtype $t --rows 1 2 3 4 5 6 7 8 --context 512 --runs 5 --steps 10 \
        --json "$OUT/spec-curve-8b-$t.json" 2>&1 | tail -14 | tee -a "$OUT/spec-curve.txt"
    done ;;
  spec)
    # speculative decoding: GPU tests, then `lodestar bench spec` on the default model at two
    # draft-length ceilings (no prefix cache: a cached prefix prefills in another shape on the
    # GPU, other bits, which would blur the on/off token comparison)
    cat .model/smol.tar.part00 .model/smol.tar.part01 | tar -x -C "$DEPS" || { echo "model halves missing"; exit 3; }
    PYTHONPATH="$PWD:$DEPS" timeout -k 10 ${TESTS_S:-240} $PY -m pytest -q -p no:cacheprovider -o addopts="" -n 8 \
      --junitxml="$OUT/pytest-spec.xml" tests/engine/test_spec_cuda.py tests/engine/test_grammar_cuda.py \
      tests/engine/test_cuda_exactness.py tests/engine/test_overlap.py tests/engine/test_spec_sampling.py \
      ${SPEC_TESTS:-} 2>&1 | tail -20 | tee "$OUT/pytest-spec.txt"
    for n in ${SPEC_TOKENS:-8 16}; do
      PYTHONPATH="$PWD:$DEPS" timeout -k 10 ${BENCH_S:-150} $PY -m lodestar.cli bench spec --device cuda \
        --no-prefix-cache --num-spec-tokens $n --runs ${RUNS:-3} --json "$OUT/spec-h200-smollm2-g$n.json" 2>&1 \
        | tail -40 | tee -a "$OUT/spec.txt"
    done ;;
  *) echo "usage: OUT=DIR $0 tests|goldens|ab|structured|spec-curve|spec"; exit 2 ;;
esac
