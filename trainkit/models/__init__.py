"""Example networks for the bundled experiments."""

from trainkit.models.mnist import MnistNet

__all__ = ["MnistNet"]
