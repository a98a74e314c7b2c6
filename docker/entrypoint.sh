#!/usr/bin/env bash
# The trainkit container's entrypoint: sshd and JupyterLab as this (non-root) user, then the
# command given to `docker run`, if any, else it waits on the services. docs/docker.md has more.
#
#   JUPYTER_TOKEN      Jupyter's token; required while Jupyter is on (there is no default)
#   TRAINKIT_JUPYTER   on (default) | off
#   JUPYTER_PORT       8888
#   SSH_PORT           2222 (an sshd that is not root cannot listen on 22)
#   AUTHORIZED_KEYS    /etc/trainkit/authorized_keys: mount your public keys there; none, no sshd
#   TRAINKIT_WORKSPACE /workspace; runs go to <it>/runs, a volume, so resume=auto survives restarts
#   TRAINKIT_DRY_RUN   1: check the settings and print what would run, start nothing
set -euo pipefail

workspace=${TRAINKIT_WORKSPACE:-/workspace}
keys=${AUTHORIZED_KEYS:-/etc/trainkit/authorized_keys}
jupyter=${TRAINKIT_JUPYTER:-on}
dry=${TRAINKIT_DRY_RUN:-0}

fail() { echo "trainkit-entrypoint: $*" >&2; exit 2; }
run() { if [[ $dry == 1 ]]; then echo "run: $*"; else "$@"; fi; }
start() { if [[ $dry == 1 ]]; then echo "start: $*"; else "$@" & fi; }

[[ $jupyter == on || $jupyter == off ]] || fail "TRAINKIT_JUPYTER=$jupyter: use on or off"
if [[ $jupyter == on && -z ${JUPYTER_TOKEN:-} ]]; then
  fail "no JUPYTER_TOKEN: pass -e JUPYTER_TOKEN=\$(openssl rand -hex 24), or TRAINKIT_JUPYTER=off"
fi
mkdir -p "$workspace/runs"
[[ -w $workspace/runs ]] || fail "$workspace/runs is not writable by uid $(id -u): use a named" \
  "volume (-v trainkit-runs:$workspace/runs) or chown the host folder to uid $(id -u)"

if [[ -f $keys && -s $keys && -r $keys ]]; then
  # The host key is made once per home folder; the keys are copied so that sshd's ownership
  # checks (StrictModes) pass whatever uid owns the mounted file.
  hostkey=$HOME/.sshd/ssh_host_ed25519_key
  mkdir -p "$HOME/.sshd" "$HOME/.ssh"
  [[ -f $hostkey ]] || run ssh-keygen -q -t ed25519 -N '' -f "$hostkey"
  run install -m 600 "$keys" "$HOME/.ssh/authorized_keys"
  # Key-only logins as this user; SSH sessions get the image's PATH (python, CUDA libraries).
  start /usr/sbin/sshd -D -e -f /dev/null -o "Port=${SSH_PORT:-2222}" -o "HostKey=$hostkey" \
    -o "PidFile=$HOME/.sshd/sshd.pid" -o "AuthorizedKeysFile=.ssh/authorized_keys" \
    -o PubkeyAuthentication=yes -o PasswordAuthentication=no \
    -o KbdInteractiveAuthentication=no -o PermitRootLogin=no -o UsePAM=no \
    -o "AllowUsers=$(id -un)" -o "Subsystem=sftp internal-sftp" \
    -o "SetEnv=PATH=$PATH LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-} TRAINKIT_DATA_DIR=${TRAINKIT_DATA_DIR:-}"
elif [[ -e $keys ]]; then
  fail "$keys is empty or unreadable: mount a file of public keys there (-v ~/.ssh/id_ed25519.pub:$keys:ro)"
else
  echo "trainkit-entrypoint: no SSH: mount your public keys at $keys to log in with them" >&2
fi

if [[ $jupyter == on ]]; then
  # The token reaches Jupyter through the environment (JUPYTER_TOKEN), never the command line.
  start jupyter lab --ServerApp.ip=0.0.0.0 "--ServerApp.port=${JUPYTER_PORT:-8888}" \
    --ServerApp.open_browser=False "--ServerApp.root_dir=$workspace"
fi

if (($#)); then
  if [[ $dry == 1 ]]; then echo "exec: $*"; exit 0; fi
  exec "$@"
fi
[[ $dry == 1 ]] && exit 0
[[ -n $(jobs -p) ]] || fail "nothing to run: no token, no keys and no command"
trap 'kill -TERM $(jobs -p) 2>/dev/null; wait' TERM INT
wait -n  # a service ended: so does the container (a restart policy brings it back)
