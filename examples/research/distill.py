"""Knowledge distillation: a teacher trained first, then a small student on KL + CE to it.

    python examples/research/distill.py --run-dir runs/distill

Two phases, each a ``fit`` with its own run dir (``teacher/``, ``student/``), the script under
``trainkit.preemptible()``: a signal anywhere stops it with exit status 75, and the same command
resumes it (a finished teacher is not trained again). The student's step is yours: the frozen
teacher (a model no optimizer holds: kept in eval mode, never wrapped by DDP) under no_grad,
the loss's parts logged as ``train/kl`` and ``train/ce``.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from digits import CLASSES, SIZE, digit_of, digits
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

import trainkit
from trainkit import CheckpointConfig, InMemoryLoader, Trainer, TrainerConfig

T, ALPHA = 2.0, 0.7  # the softmax temperature, the KL's share of the loss


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(SIZE * SIZE, hidden), nn.ReLU(),
                         nn.Linear(hidden, CLASSES))


def as_digits(model: nn.Module, batch):  # the loader's label holds the digit and the shift
    return model(batch[0]), digit_of(batch[1])


def evaluate_student(ctx: trainkit.EvalContext, batch):
    return as_digits(ctx.models["student"], batch)


def distill_step(ctx: trainkit.StepContext, batch) -> None:
    x, y = batch[0], digit_of(batch[1])
    with torch.no_grad():
        teacher = ctx.models["teacher"](x)
    student = ctx.models["student"](x)
    kl = F.kl_div(F.log_softmax(student / T, 1), F.log_softmax(teacher / T, 1),
                  log_target=True, reduction="batchmean") * T * T
    ce = F.cross_entropy(student, y)
    ctx.optimize("student", (ALPHA * kl + (1 - ALPHA) * ce, {"kl": kl, "ce": ce}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/distill")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    with trainkit.preemptible():
        train, val = digits(2048, seed=1), digits(512, seed=2)
        config = TrainerConfig(max_epochs=args.epochs, device="cpu", log_every_n_steps=16)
        checkpoint = CheckpointConfig(every_n_steps=16, keep_last=2)
        acc = {"acc": MulticlassAccuracy(CLASSES)}

        def fit(name: str, models, optimizer, **how) -> dict:
            return Trainer(config, run_dir=f"{args.run_dir}/{name}", checkpoint=checkpoint).fit(
                models, optimizer, InMemoryLoader(train, 64, shuffle=True, seed=1),
                val_data=InMemoryLoader(val, 256, shuffle=False), metrics=acc,
                criterion=F.cross_entropy, **how)

        torch.manual_seed(0)
        teacher, student = mlp(256), mlp(24)
        taught = fit("teacher", teacher, torch.optim.Adam(teacher.parameters(), 3e-3),
                     forward=as_digits)
        learnt = fit("student", {"student": student, "teacher": teacher},
                     {"student": torch.optim.Adam(student.parameters(), 1e-2)},
                     step=distill_step, evaluate=evaluate_student)
        print(f"teacher val/acc {taught['metrics']['val/acc']:.4f}, student val/acc "
              f"{learnt['metrics']['val/acc']:.4f}")


if __name__ == "__main__":
    main()
