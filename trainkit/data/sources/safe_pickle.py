"""A restricted unpickler for CIFAR-10's python files.

``pickle.load`` runs whatever callables a file names, so a tampered download could run code.
CIFAR-10's batches hold only dicts, lists, byte strings, ints and NumPy arrays; this unpickler
resolves exactly the globals NumPy arrays need and refuses every other one.
"""

from __future__ import annotations

import pickle
from typing import IO, Any

import numpy as np

from trainkit.core.errors import TrainkitError

try:  # NumPy 2 moved the array reconstructor; files written by NumPy 1 still name the old module
    from numpy._core.multiarray import _reconstruct
except ImportError:  # pragma: no cover - NumPy 1
    from numpy.core.multiarray import _reconstruct

# (module, name) as written in the file -> the object it stands for. Resolved here rather than
# by importing the named module: `numpy.core` warns on import under NumPy 2.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy", "dtype"): np.dtype,
}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles plain containers and NumPy arrays; any other global is a :class:`TrainkitError`."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED_GLOBALS[(module, name)]
        except KeyError:
            raise TrainkitError(
                f"the pickle names {module}.{name}, which a CIFAR-10 file never holds "
                "(only dicts, lists, bytes, ints and NumPy arrays are admitted)"
            ) from None


def load_restricted(file: IO[bytes]) -> Any:
    """Unpickle ``file`` as CIFAR-10's files need (``encoding="bytes"``: they come from Python 2).

    Raises:
        TrainkitError: the pickle names a global other than NumPy's array reconstruction.
    """
    return RestrictedUnpickler(file, encoding="bytes").load()
