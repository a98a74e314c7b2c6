"""docker/entrypoint.sh, outside a container: which services it starts with which settings
(TRAINKIT_DRY_RUN=1 prints them), and what it refuses. This machine cannot build the image."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
TOKEN = "s3cret-token-never-printed"


def _entrypoint(tmp_path: Path, *command: str, keys: str | None = "ssh-ed25519 AAAA me@laptop",
                **env: str) -> subprocess.CompletedProcess[str]:
    key_file = tmp_path / "authorized_keys"
    if keys is not None:
        key_file.write_text(keys)
    settings = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "home"),
                "TRAINKIT_WORKSPACE": str(tmp_path / "workspace"),
                "AUTHORIZED_KEYS": str(key_file), "TRAINKIT_DRY_RUN": "1"}
    return subprocess.run(["bash", str(ENTRYPOINT), *command], env={**settings, **env},
                          capture_output=True, text=True, timeout=30)


def _started(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """The services a dry run would start, by program name."""
    lines = [line[len("start: "):] for line in proc.stdout.splitlines()
             if line.startswith("start: ")]
    return {Path(line.split()[0]).name: line for line in lines}


def test_starts_key_only_sshd_and_jupyter_with_its_token_from_the_environment(
        tmp_path: Path) -> None:
    proc = _entrypoint(tmp_path, JUPYTER_TOKEN=TOKEN, JUPYTER_PORT="8899")
    assert proc.returncode == 0, proc.stderr
    started = _started(proc)
    assert sorted(started) == ["jupyter", "sshd"]
    sshd = started["sshd"]
    for option in ("Port=2222", "PubkeyAuthentication=yes", "PasswordAuthentication=no",
                   "KbdInteractiveAuthentication=no", "PermitRootLogin=no", "UsePAM=no",
                   "-f /dev/null", f"SetEnv=PATH={os.environ['PATH']} "):
        assert option in sshd, option
    home = tmp_path / "home"
    assert f"HostKey={home}/.sshd/ssh_host_ed25519_key" in sshd
    # the mounted keys are copied where sshd's ownership checks accept them
    install = f"run: install -m 600 {tmp_path}/authorized_keys {home}/.ssh/authorized_keys"
    assert install in proc.stdout
    assert re.search(r"run: ssh-keygen .*-f \S+/ssh_host_ed25519_key", proc.stdout)
    jupyter = started["jupyter"]
    assert jupyter.startswith("jupyter lab --ServerApp.ip=0.0.0.0 --ServerApp.port=8899")
    assert f"--ServerApp.root_dir={tmp_path}/workspace" in jupyter
    assert TOKEN not in proc.stdout + proc.stderr  # not on a command line `ps` shows
    assert (tmp_path / "workspace" / "runs").is_dir()


def test_refuses_to_start_jupyter_without_a_token(tmp_path: Path) -> None:
    for token in ({}, {"JUPYTER_TOKEN": ""}):
        proc = _entrypoint(tmp_path, **token)
        assert proc.returncode == 2
        assert proc.stdout == ""  # nothing started, sshd included
        assert proc.stderr.count("\n") == 1 and "no JUPYTER_TOKEN" in proc.stderr
        assert "TRAINKIT_JUPYTER=off" in proc.stderr


def test_without_jupyter_it_runs_the_given_command_after_sshd(tmp_path: Path) -> None:
    proc = _entrypoint(tmp_path, "python", "-m", "trainkit.train", "+exp=mnist",
                       TRAINKIT_JUPYTER="off")
    assert proc.returncode == 0, proc.stderr
    assert sorted(_started(proc)) == ["sshd"]
    assert proc.stdout.splitlines()[-1] == "exec: python -m trainkit.train +exp=mnist"


def test_without_keys_there_is_no_sshd_and_bad_mounts_are_refused(tmp_path: Path) -> None:
    proc = _entrypoint(tmp_path, keys=None, JUPYTER_TOKEN=TOKEN)
    assert proc.returncode == 0 and sorted(_started(proc)) == ["jupyter"]
    assert "no SSH: mount your public keys at" in proc.stderr
    # `docker run -v` of a missing host file mounts an empty directory in its place
    (tmp_path / "authorized_keys").mkdir()
    proc = _entrypoint(tmp_path, keys=None, JUPYTER_TOKEN=TOKEN)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "is empty or unreadable" in proc.stderr and proc.stderr.count("\n") == 1


def test_a_misspelt_switch_is_refused(tmp_path: Path) -> None:
    proc = _entrypoint(tmp_path, JUPYTER_TOKEN=TOKEN, TRAINKIT_JUPYTER="no")
    assert proc.returncode == 2 and proc.stdout == ""
    assert "TRAINKIT_JUPYTER=no: use on or off" in proc.stderr


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_a_runs_folder_it_cannot_write_is_refused(tmp_path: Path) -> None:
    runs = tmp_path / "workspace" / "runs"
    runs.mkdir(parents=True)
    runs.chmod(0o555)
    proc = _entrypoint(tmp_path, JUPYTER_TOKEN=TOKEN)
    assert proc.returncode == 2 and "-v trainkit-runs:" in proc.stderr


def test_the_image_pins_its_base_runs_as_a_user_and_keeps_runs_on_a_volume() -> None:
    text = (REPO / "docker" / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M).group(1)
    assert re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda[\d.]+-cudnn\d+-runtime", base)
    assert re.findall(r"^USER (\S+)$", text, re.M) == ["${APP_USER}"]
    assert 'VOLUME ["/workspace/runs"]' in text
    assert "docker/entrypoint.sh /usr/local/bin/trainkit-entrypoint" in text
