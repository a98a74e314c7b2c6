"""The `+exp=mnist` recipe written by hand: what `benchmarks.mnist_e2e` times trainkit against.

    python -m benchmarks.hand_mnist --data-root /work/shared/data --seed 0
    python -m benchmarks.hand_mnist --data-root <fake> --steps 5 --precision 32   # a smoke run

What someone who knows the recipe writes in one file with the usual parts: torchvision's MNIST
reader, the same net (trainkit.models.MnistNet, restated here so that nothing of trainkit is
imported), batches of 256 drawn from one shuffled pass over the training set held as a tensor and
normalised per batch, channels_last, ``torch.optim.AdamW`` (fused, lr 0.02, weight decay 0.01),
``OneCycleLR`` (25% warm-up), cross-entropy with label smoothing 0.1, 188 steps, bf16 autocast when
asked (as trainkit's ``auto`` picks it), then test accuracy with torchmetrics'
``MulticlassAccuracy`` in batches of 1000. No logging, checkpoint or run directory; a plain exit.
It prints one JSON line: test accuracy and the training loop's seconds.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR
from torchmetrics.classification import MulticlassAccuracy
from torchvision.datasets import MNIST

MEAN, STD = 0.1307, 0.3081  # MNIST's pixel statistics on the 0-1 scale


def block(c_in: int, c_out: int) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, 3, bias=False), nn.MaxPool2d(2), nn.BatchNorm2d(c_out),
            nn.ReLU(inplace=True)]


def make_net(widths: tuple[int, int, int] = (32, 96, 256)) -> nn.Module:
    """trainkit.models.MnistNet's layers, in the same order (so the same initial weights)."""
    w1, w2, w3 = widths

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.PixelUnshuffle(2), *block(4, w1), *block(w1, w2), nn.Flatten(),
                nn.Linear(4 * w2, w3, bias=False), nn.BatchNorm1d(w3), nn.ReLU(inplace=True))
            self.head = nn.Linear(w3, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.features(x))

    return Net()


def normalised(images: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 28, 28] -> float [N, 1, 28, 28], zero mean and unit spread, channels_last."""
    x = images.unsqueeze(1).to(torch.float32, memory_format=torch.channels_last)
    return x.sub_(MEAN * 255).div_(STD * 255)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=188)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--precision", choices=("32", "bf16-mixed"), default="32")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    train, test = MNIST(args.data_root, train=True), MNIST(args.data_root, train=False)
    model = make_net().to(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=True)
    scheduler = OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.steps, pct_start=0.25)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    bf16 = args.precision == "bf16-mixed"
    started = time.perf_counter()
    order = torch.randperm(len(train.data))
    model.train()
    for step in range(args.steps):
        index = order[step * args.batch_size:(step + 1) * args.batch_size]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = criterion(model(normalised(train.data[index])), train.targets[index])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    train_s = time.perf_counter() - started
    accuracy = MulticlassAccuracy(num_classes=10, average="micro")
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for i in range(0, len(test.data), 1000):
            accuracy.update(model(normalised(test.data[i:i + 1000])), test.targets[i:i + 1000])
    result = {"val_acc": float(accuracy.compute()), "train_s": train_s}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
