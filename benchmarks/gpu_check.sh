#!/usr/bin/env bash
# Every CUDA path of trainkit in one short run, for a machine with a GPU (a few minutes on one H200).
#
#   bash benchmarks/gpu_check.sh --fetch-wheels   # here, with package-registry access, once: puts
#                                                 # hydra-core, omegaconf and antlr4 wheels in .whl/
#   bash benchmarks/gpu_check.sh                  # there: all checks; results under $OUT
#
# The GPU machine has torch, torchvision, tensorboard, torchmetrics, tqdm, psutil and pytest but
# no Hydra, so the wheels travel with the working tree (`.whl` is git-ignored; carry it). Checks:
#   1. the unit tests on CUDA (device errors, prefetcher, async snapshot, loaders, precision)
#   2. fp16 + GradScaler and bf16 runs of +exp=cifar: finite loss, loss scale and CUDA memory
#      read back from TensorBoard, few skipped steps
#   3. torchrun with one process; NCCL and gloo collectives through trainkit's CUDA backend string
#   4. python -m benchmarks.gpu: throughput, shaped +exp=cifar run, AMP speed-up, peak memory
# Every check runs even when an earlier one failed; the last lines say which passed.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
        hydra-core==1.3.2 omegaconf==2.3.0 || exit 1
    python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3 || exit 1  # sdist only
    ls .whl
    exit 0
fi

OUT=${OUT:-/tmp/trainkit-gpu-check}
mkdir -p "$OUT"
PY=python3
if ! $PY -c "import hydra" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        .whl/*.whl || { echo "FAIL: no Hydra and no .whl/ to install it from"; exit 1; }
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
declare -A RESULT

check() {  # check NAME COMMAND...: run it, log to $OUT/NAME.log, remember pass/fail
    local name=$1; shift
    echo "== $name"
    if "$@" > "$OUT/$name.log" 2>&1; then RESULT[$name]=PASS; else RESULT[$name]="FAIL (see $name.log)"; fi
    tail -n 5 "$OUT/$name.log"
}

nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
$PY -m trainkit.env > "$OUT/env.txt" 2>&1

DATA=$(mktemp -d)
$PY -c "from pathlib import Path; from tests.fakes import write_fake_cifar10; \
write_fake_cifar10(Path('$DATA'), n_train=10000, n_test=1000)"
RUN="data.root=$DATA data.verify=false data.download=false trainer.max_epochs=2"

check unit_tests $PY -m pytest -q -p no:cacheprovider -m "not slow and not dist" tests/unit

amp_run() {  # amp_run PRECISION: a short +exp=cifar run; its summary and TensorBoard read back
    local dir="$OUT/run_$1"
    $PY -m trainkit.train +exp=cifar $RUN trainer.precision="$1" hydra.run.dir="$dir" || return 1
    $PY - "$dir" "$1" <<'EOF'
import json, math, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
run, precision = sys.argv[1], sys.argv[2]
summary = json.load(open(f"{run}/summary.json"))
events = EventAccumulator(f"{run}/tb").Reload()
tags = events.Tags()["scalars"]
losses = [e.value for e in events.Scalars("train/loss")]
assert summary["status"] == "completed", summary
assert all(math.isfinite(v) for v in losses), losses
assert summary["skipped_steps"] < summary["global_step"] // 2, summary  # overflows: a few
assert "memory/cuda_peak_allocated_gib" in tags, tags
assert ("amp/loss_scale" in tags) == (precision == "16-mixed"), tags
print(precision, "ok:", summary["samples_per_s"], "samples/s,", summary["peak_memory"])
EOF
}
check fp16_gradscaler amp_run 16-mixed
check bf16 amp_run bf16-mixed

nccl_run() {  # one GPU allows one NCCL rank: the run under torchrun, then the backend trainkit
    local dir="$OUT/run_nccl"  # asks for on CUDA (cpu:gloo,cuda:nccl) with collectives on both
    $PY -m torch.distributed.run --standalone --nproc-per-node=1 -m trainkit.train +exp=cifar $RUN \
        hydra.run.dir="$dir" || return 1
    test -f "$dir/checkpoints/last.pt" || return 1
    $PY - <<'EOF'
import torch, torch.distributed as dist
dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1, store=dist.HashStore(),
                        device_id=torch.device("cuda", 0))
on_gpu, on_cpu = torch.ones(4, device="cuda"), torch.ones(4)
dist.all_reduce(on_gpu)
dist.all_reduce(on_cpu)
dist.barrier()
assert on_gpu.sum().item() == 4 and on_cpu.sum().item() == 4
print("nccl", torch.cuda.nccl.version(), "and gloo collectives ok")
dist.destroy_process_group()
EOF
}
check nccl_one_process nccl_run

check benchmark $PY -m benchmarks.gpu --out "$OUT/gpu.json"

echo "== results"
for name in unit_tests fp16_gradscaler bf16 nccl_one_process benchmark; do
    echo "$name: ${RESULT[$name]}"
done | tee "$OUT/results.txt"
! grep -q FAIL "$OUT/results.txt"
