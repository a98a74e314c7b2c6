#!/usr/bin/env bash
# Every CUDA path of trainkit once, for a machine with a GPU, in batches that each fit one call
# of a lent machine (one H100 or H200, 10 minutes a call, 15 minutes in all).
#
#   PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh --fetch-wheels
#       here, with package-registry access, once: builds .whl/ (hydra-core, omegaconf and
#       antlr4 wheels, pure Python; .whl is git-ignored: carry it to the GPU machine)
#   bash benchmarks/gpu_check.sh --plan
#       anywhere (no GPU needed): the batches, each case's expected seconds on one H100, each
#       batch's total (<= 8 minutes) and the whole (<= 14), and the exact device call of each
#       (command, carry: [".whl"], timeout_s); exit 1 when the plan does not fit
#   bash benchmarks/gpu_check.sh [--batch N | --only case,case] <out_dir>
#       there: the batch's cases (or the named ones; without either, every case), then each
#       case with PASS/FAIL/NOT RUN and the torch/CUDA versions; <out_dir>/gpu_check.json,
#       rewritten after every case, and gpu_check.log. No case starts after 8 minutes.
#
# A GPU machine may have torch, torchvision, tensorboard, pytest, ... but no Hydra: then it is
# installed from .whl/ into a temporary folder, and without .whl/ the check fails in one line.
# Exit status 0 only when every case passed (a GPU-marked test skipped, or a case not run, is a
# failure, but on a one-GPU machine for the nccl case's NOT RUN (needs 2 GPUs) and a GPU test
# skipped because it "needs 2 GPUs", listed in gpu_tests' result); 1 when one
# failed, or when nvidia-smi sees a GPU that torch cannot use; on a
# machine without a GPU it says so in one line and exits 0. The cases run in a temporary folder.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${WHEELS:-.whl}  # where --fetch-wheels puts the wheels and the check installs them from

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    # the versions $PY has (the project's venv), one of each: two versions stop the install
    read -r hydra omegaconf antlr < <($PY -c "from importlib.metadata import version as v
print(*(f'{n}=={v(n)}' for n in ('hydra-core', 'omegaconf', 'antlr4-python3-runtime')))") \
        || { echo "gpu_check: run --fetch-wheels with PYTHON= a Python that has Hydra" >&2; exit 1; }
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    $PY -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "$hydra" "$omegaconf" \
        || exit 1
    $PY -m pip wheel -q --no-deps -w "$WHEELS" "$antlr" || exit 1  # an sdist only: built here
    ls "$WHEELS"
    exit 0
fi
if [[ "${1:-}" == "--plan" ]]; then
    exec $PY -m benchmarks.gpu_check --plan
fi
select=()  # --batch N or --only names, passed on
while [[ "${1:-}" == --batch || "${1:-}" == --only ]]; do
    [[ $# -ge 2 ]] || { echo "gpu_check: $1 needs a value" >&2; exit 2; }
    select+=("$1" "$2")
    shift 2
done
if [[ $# -ne 1 || "$1" == -* ]]; then
    echo "usage: bash benchmarks/gpu_check.sh [--batch N | --only case,case] <out_dir>" \
         "  (or --plan, --fetch-wheels)" >&2
    exit 2
fi
if ! why=$($PY -c "import torch; torch.cuda.init()" 2>&1); then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
    if [[ ${gpus:-0} -gt 0 ]]; then
        echo "gpu_check: FAIL: nvidia-smi sees $gpus GPU(s) but torch cannot use CUDA:" \
             "$(tail -n 1 <<<"$why" | cut -c1-200)"
        exit 1
    fi
    echo "gpu_check: skipped: CUDA is not available on this machine"
    exit 0
fi
if ! $PY -c "import hydra, omegaconf" 2>/dev/null && ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "gpu_check: FAIL: no Hydra here and no $WHEELS/ to install it from: run" \
         "'bash benchmarks/gpu_check.sh --fetch-wheels' where pip reaches PyPI, and bring .whl/"
    exit 1
fi
mkdir -p "$1" || exit 2
out=$(cd "$1" && pwd)

site=$(mktemp -d)
if ! $PY -c "import hydra, omegaconf" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$WHEELS"/*.whl || { echo "gpu_check: FAIL: the wheels in $WHEELS/ did not install"
                             exit 1; }
fi
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    nvidia-smi
    $PY -m trainkit.env
    $PY -m benchmarks.gpu_check ${select[@]+"${select[@]}"} "$out"
} 2>&1 | tee "$out/gpu_check.log"
status=${PIPESTATUS[0]}
rm -rf "$site"
exit "$status"
