"""The training loop: Trainer, step, precision, NaN/inf guard, EMA, evaluation, callbacks."""
