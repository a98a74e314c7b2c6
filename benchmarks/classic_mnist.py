"""The classic MNIST baseline: PyTorch's examples/mnist/main.py way, one epoch, then test accuracy.

    python -m benchmarks.classic_mnist --data-root /work/shared/data
    python -m benchmarks.classic_mnist --data-root <fake> --limit 512     # a tiny slice

What a researcher writes from the official example: ``torchvision.datasets.MNIST`` decoding each
sample to a PIL image and back through ``ToTensor() + Normalize((0.1307,), (0.3081,))``, a
``DataLoader(batch_size=64, shuffle=True)``, the two-conv ``Net`` with dropout, Adadelta (lr 1.0)
and ``StepLR(gamma=0.7)``, test batch 1000. Nothing is tuned for speed beyond what the example
does; torch's thread settings are left at their defaults, as for trainkit's run. The example only
uses a loader worker on CUDA; here ``--num-workers`` (default 1, the example's CUDA value) lets
decoding overlap compute, which helps the baseline on a 2-core CPU.

It prints one JSON line: test accuracy and test loss. (``benchmarks.mnist_e2e`` timed trainkit
against it until 2026-12-02; it now times the same recipe as trainkit's written by hand,
``benchmarks/hand_mnist.py``.)
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, Subset
from torchvision import datasets, transforms


class Net(nn.Module):
    """The examples' network: conv 32, conv 64, max-pool, dropout, fc 128, dropout, fc 10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = self.dropout2(x)
        return F.log_softmax(self.fc2(x), dim=1)


def train(model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer) -> None:
    model.train()
    for data, target in loader:
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()


@torch.no_grad()
def test(model: nn.Module, loader: DataLoader) -> tuple[float, float]:
    """Mean test loss and accuracy, as the example computes them."""
    model.eval()
    loss, correct = 0.0, 0
    for data, target in loader:
        output = model(data)
        loss += F.nll_loss(output, target, reduction="sum").item()
        correct += output.argmax(dim=1).eq(target).sum().item()
    n = len(loader.dataset)
    return loss / n, correct / n


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True, help="folder holding MNIST/raw")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--limit", type=int, default=0, help="use only the first N samples")
    parser.add_argument("--seed", type=int, default=1)  # the example's default seed
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    transform = transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))]
    )
    # download=False: the files are already there, and the benchmark must not touch the network.
    train_set = datasets.MNIST(args.data_root, train=True, download=False, transform=transform)
    test_set = datasets.MNIST(args.data_root, train=False, download=False, transform=transform)
    if args.limit:
        train_set = Subset(train_set, range(min(args.limit, len(train_set))))
        test_set = Subset(test_set, range(min(args.limit, len(test_set))))
    train_loader = DataLoader(train_set, batch_size=64, shuffle=True, num_workers=args.num_workers)
    test_loader = DataLoader(test_set, batch_size=1000, num_workers=args.num_workers)
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.7)
    for _ in range(args.epochs):
        train(model, train_loader, optimizer)
        test_loss, accuracy = test(model, test_loader)
        scheduler.step()
    result = {"val_acc": accuracy, "val_loss": test_loss}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
