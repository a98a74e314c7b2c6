#!/usr/bin/env bash
# Every CUDA path of trainkit once, for a machine with a GPU (aims at <= 8 minutes on one H200).
#
#   bash benchmarks/gpu_check.sh --fetch-wheels   # here, with package-registry access, once: puts
#                                                 # hydra-core, omegaconf and antlr4 wheels in .whl/
#   bash benchmarks/gpu_check.sh <out_dir>        # there: all cases; writes <out_dir>/gpu_check.json
#                                                 # and <out_dir>/gpu_check.log
#
# A GPU machine may have torch, torchvision, tensorboard, torchmetrics, tqdm, psutil and pytest but
# no Hydra: then the wheels travel with the working tree (`.whl` is git-ignored; carry it). The
# cases (python -m benchmarks.gpu_check; its docstring lists them) run in a temporary folder.
# Without CUDA it says so in one line and exits 0. Exit status 1 when a case failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    $PY -m pip download -q --no-deps --only-binary=:all: -d .whl \
        hydra-core==1.3.2 omegaconf==2.3.0 || exit 1
    $PY -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3 || exit 1  # sdist only
    ls .whl
    exit 0
fi
if [[ $# -ne 1 || "$1" == -* ]]; then
    echo "usage: bash benchmarks/gpu_check.sh <out_dir>   (or --fetch-wheels)" >&2
    exit 2
fi
if ! $PY -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "gpu_check: skipped: CUDA is not available on this machine"
    exit 0
fi
mkdir -p "$1" || exit 2
out=$(cd "$1" && pwd)

site=$(mktemp -d)
if ! $PY -c "import hydra" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        .whl/*.whl || { echo "gpu_check: no Hydra and no .whl/ to install it from" >&2; exit 1; }
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    nvidia-smi
    $PY -m trainkit.env
    $PY -m benchmarks.gpu_check "$out"
} 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
rm -rf "$site"
exit "$status"
