"""An export folder's files are written with the umask's permissions, whatever the format."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from torch import nn

from trainkit.checkpoint.export import Inputs, export


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_weights_file_has_the_umask_mode_as_model_json(tmp_path: Path, fmt: str) -> None:
    inputs = Inputs((0.5,), (0.25,), (1, 4, 4), ["a", "b"])
    before = os.umask(0o022)
    try:
        out = export(nn.Sequential(nn.Flatten(), nn.Linear(16, 2)), tmp_path / "out", fmt=fmt,
                     dtype="fp32", inputs=inputs, info={})
    finally:
        os.umask(before)
    record = json.loads((out / "model.json").read_text())
    modes = {name: stat.S_IMODE((out / name).stat().st_mode)
             for name in (record["file"], "model.json")}
    assert modes == {record["file"]: 0o644, "model.json": 0o644}
