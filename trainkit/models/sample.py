"""A callback that shows what a language model writes: a short sample after each evaluation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from trainkit.data.tools.tokenize import Tokenizer, get_tokenizer
from trainkit.models.gpt import generate


class PrintSample:
    """After each evaluation, rank 0 prints ``length`` tokens the model writes after ``prompt``.

    Stateful: its random stream and count are in every checkpoint (``state_key``), so a resumed
    run prints what the uninterrupted one would. Callbacks run on every rank: this one acts on
    rank 0 only. The entry point hands it the run's model (:meth:`set_model`) when the callback
    is named in the config (``+exp=lm`` does: ``callbacks.sample``).

    Args:
        model: the model (a :class:`~trainkit.models.GPT`); None until :meth:`set_model`.
        prompt: text the sample continues, encoded with ``tokenizer``.
        length: tokens to sample.
        tokenizer: ``bytes`` or ``gpt2`` (the corpus's, see ``python -m trainkit.data tokenize``).
    """

    state_key = "sample"

    def __init__(self, model: nn.Module | None = None, prompt: str = "def ", length: int = 60,
                 tokenizer: str | Tokenizer = "bytes") -> None:
        self.model, self.prompt, self.length = model, prompt, length
        self.tokenizer = get_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.generator = torch.Generator().manual_seed(0)
        self.printed = 0

    def set_model(self, model: nn.Module) -> None:
        """The model to sample from (the entry point calls this once the model is built)."""
        self.model = model

    def on_evaluation_end(self, trainer: Any, results: Mapping[str, float], step: int) -> None:
        if not trainer.runtime.is_main or self.model is None:
            return
        ids = generate(self.model, self.tokenizer.encode(self.prompt), self.length,
                       self.generator)
        self.printed += 1
        print(f"sample at step {step}: {self.tokenizer.decode(ids)!r}", flush=True)

    def state_dict(self) -> dict[str, Any]:
        return {"printed": self.printed, "generator": self.generator.get_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.printed = int(state["printed"])
        self.generator.set_state(state["generator"])
