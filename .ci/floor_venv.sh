#!/usr/bin/env bash
# Build the torch-floor venv (make test-floor): FLOOR_TORCH's torch and torchvision in a venv of
# their own, every other package from the main venv (the same versions the suite runs on), behind
# them on sys.path through a .pth file. Kept while FLOOR_TORCH is unchanged: the stamp names it.
# --no-deps: torch's CUDA libraries (nvidia-*), triton and the rest come from the main venv too
# (torch finds nvidia/*/lib on sys.path), a ~0.5 GB download instead of ~2.6 GB. Those are the
# main torch's pins, not the floor's (newer cuDNN, NCCL, triton): a venv for the CPU unit tests,
# not for GPU work on the floor torch.
set -euo pipefail
python=$1 main_py=$2 floor=$3 torch_pin=$4
stamp=$floor/.installed
if [ "$(cat "$stamp" 2>/dev/null)" = "$torch_pin" ]; then exit 0; fi
rm -rf "$floor"
"$python" -m venv "$floor"
# shellcheck disable=SC2086  # the pin is a list of requirements
"$floor/bin/python" -m pip install --quiet --no-deps --no-compile $torch_pin
purelib='import sysconfig; print(sysconfig.get_paths()["purelib"])'
floor_site=$("$floor/bin/python" -c "$purelib")
"$floor/bin/python" -m compileall -q -q -j 0 "$floor_site" || true  # as the Makefile's COMPILE_SITE
main_site=$("$main_py" -c "$purelib")
echo "import site; site.addsitedir('$main_site')" > "$floor_site/trainkit-main-venv.pth"
echo "$torch_pin" > "$stamp"
