"""Downloads of the built-in datasets with torchvision, for `python -m trainkit.data download`
and for a first run with ``data.download=true``: a failed one leaves no empty folders and says
each error once."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path

from trainkit.core.errors import chain_lines

CIFAR10_FOLDER = "cifar-10-batches-py"


def download_mnist(root: str | Path) -> None:
    """Download MNIST's four files (md5-checked) into ``<root>/MNIST/raw`` with torchvision;
    a failed download leaves no folder it made."""
    from torchvision.datasets import MNIST  # a slow import: only to download

    with _no_folders_left_empty(Path(root) / "MNIST" / "raw"):
        MNIST(str(root), train=False, download=True)


def download_cifar10(root: str | Path) -> None:
    """Download and unpack torchvision's CIFAR-10 archive (md5-checked) under ``root``;
    a failed download leaves no folder it made."""
    from torchvision.datasets import CIFAR10
    from torchvision.datasets.utils import download_and_extract_archive

    with _no_folders_left_empty(Path(root) / CIFAR10_FOLDER):
        download_and_extract_archive(CIFAR10.url, str(root), filename=CIFAR10.filename,
                                     md5=CIFAR10.tgz_md5)


@contextlib.contextmanager
def _no_folders_left_empty(folder: Path) -> Iterator[None]:
    """On an error, remove the folders on the way to ``folder`` that the block made and left
    empty (an offline download's ``MNIST/raw``), deepest first; none that existed before."""
    made = [path for path in (folder, *folder.parents) if not path.exists()]
    try:
        yield
    except BaseException:
        for path in made:
            try:
                if path.is_dir():  # (the block may not have got as far as making it)
                    path.rmdir()
            except OSError:  # not empty: keep it and the folders above it
                break
        raise


# torchvision's MNIST names each mirror it tried and its error: offline, the same error each time
_MIRROR_TRIED = re.compile(r"Tried (\S+), got: (.*?)(?= Tried \S+, got: |$)")


def download_error_lines(err: BaseException) -> list[str]:
    """``err`` and its causes as :func:`~trainkit.core.errors.chain_lines`, each error said once:
    mirrors that all failed alike are named together with the one error, and a cause the line
    before already quotes (``URLError: <urlopen error X>`` of ``OSError: X``) is left out."""
    lines: list[str] = []
    for line in chain_lines(err):
        tried = _MIRROR_TRIED.findall(line)
        if len(tried) > 1 and len({why for _, why in tried}) == 1:
            mirrors = ", ".join(mirror for mirror, _ in tried)
            line = f"{line[:line.index(' Tried ')]} every mirror ({mirrors}) failed: {tried[0][1]}"
        if not (lines and line.split(": ", 1)[-1] in lines[-1]):
            lines.append(line)
    return lines
