#!/usr/bin/env bash
# The redesign's proof on the lent GPU, in two calls (each under the device's 10-minute limit):
#
#   OUT=DIR bash scripts/device_ab.sh tests    # GPU tests of this tree -> $OUT/pytest.xml
#   OUT=DIR bash scripts/device_ab.sh ab       # this tree against .ab/base -> $OUT/ab.json
#   OUT=DIR bash scripts/device_ab.sh goldens  # the real default model's GPU tests (its package
#                                              # carried as .model/smol.tar.part00 + part01)
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
for pkg in gguf yaml:pyyaml tqdm jinja2 markupsafe pytest:pytest,pluggy,iniconfig,packaging xdist:pytest-xdist,execnet; do
  mod=${pkg%%:*}; names=${pkg#*:}; [ "$names" = "$pkg" ] && names=$mod
  $PY -c "import $mod" 2>/dev/null && continue
  for n in ${names//,/ }; do
    $PY -m pip install -q --no-index --no-deps --target "$DEPS" --find-links .whl "$n" >> "$OUT/install.log" 2>&1 || echo "no wheel for $n"
  done
done
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
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
  *) echo "usage: OUT=DIR $0 tests|goldens|ab"; exit 2 ;;
esac
