"""Example networks for the bundled experiments."""

from trainkit.models.cifar import CifarNet
from trainkit.models.mnist import MnistNet

__all__ = ["CifarNet", "MnistNet"]
