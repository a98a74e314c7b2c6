"""Networks for the bundled experiments: MNIST, CIFAR-10 and a small GPT (``+exp=lm``)."""

from trainkit.models.cifar import CifarNet
from trainkit.models.gpt import GPT, Perplexity, lm_forward, lm_loss
from trainkit.models.mnist import MnistNet
from trainkit.models.sample import PrintSample

__all__ = ["GPT", "CifarNet", "MnistNet", "Perplexity", "PrintSample", "lm_forward", "lm_loss"]
