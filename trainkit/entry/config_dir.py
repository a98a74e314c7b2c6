"""Where the entry point's YAML configs are (in a checkout and in an installed package), and
the schema they fill in.

One copy lives at the top of the repository (``configs/``); building a wheel or an sdist ships it
inside the package as ``trainkit/configs`` (pyproject.toml maps it there). An editable install or
a plain checkout runs the package from the repository, so the top-level folder is found instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_PACKAGE = Path(__file__).resolve().parents[1]  # trainkit/, above entry/


def config_dir() -> Path:
    """The folder holding ``train.yaml`` and the config groups (``exp/``, ``model/``, ...).

    The packaged copy comes first: in site-packages a sibling ``configs/`` may belong to another
    distribution.
    """
    for candidate in (_PACKAGE / "configs", _PACKAGE.parent / "configs"):
        if (candidate / "train.yaml").is_file():
            return candidate
    # Neither: a broken install. Hydra's own error then names the folder it looked in.
    return _PACKAGE / "configs"


def schema() -> Any:
    """``TrainConfig`` as ``train.yaml``'s ``train_schema``, with ``data.root`` required: each
    data config gives its own (the built-in datasets' ``$TRAINKIT_DATA_DIR``), so own data
    (``data=image_folder``'s ``root: ???``) cannot fall back to the built-in datasets' folder.
    """
    from omegaconf import MISSING, OmegaConf

    from trainkit.config import TrainConfig

    node = OmegaConf.structured(TrainConfig)
    node.data.root = MISSING
    return node
