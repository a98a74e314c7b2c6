"""Real tokens per second of ``data=hf_text`` training, padded against packed (``data.pack``).

    python -m benchmarks.packing                    # CPU (or CUDA where there is one)
    python -m benchmarks.packing --quick            # tiny: checks it runs

The text is real: this Python's standard-library sources, cut into documents whose lengths are
drawn log-uniformly over 10x (``--min-chars`` to 10x that), tokenised by a byte-level BPE trained
here on them. Both sides load the split through trainkit's own pipeline
(:func:`trainkit.data.load_data` with ``HFTextConfig(pack=...)``) and train the same random-weight
GPT-2 (sdpa) with :func:`trainkit.models.hf.hf_forward`, its own loss, backward and AdamW, on
batches of ``--batch`` texts (padded to each batch's longest) or ``--batch`` windows of
``--seq-len`` tokens (packed); the real tokens of each batch are counted as the Trainer counts
them (:func:`trainkit.data.sources.packing.real_tokens`). Sides alternate in palindromic rounds
(:mod:`benchmarks.common`); the figure is the median over rounds of packed / padded real tokens
per second. Packing's one-off tokenising at load is timed apart.
"""

from __future__ import annotations

import argparse
import random
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import alternate, emit, median, ratio, row

GOAL = 1.5  # packed real tokens/s over padded's, on lengths varying 10x
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def documents(count: int, min_chars: int, seed: int = 0) -> list[str]:
    """``count`` pieces of the standard library's sources, cut one after another, each of a
    length drawn log-uniformly in ``[min_chars, 10 * min_chars]`` characters."""
    rng = random.Random(seed)
    text = "\n".join(p.read_text(encoding="utf-8", errors="ignore")
                     for p in sorted(STDLIB.glob("*.py")))
    docs, at = [], 0
    for _ in range(count):
        n = int(min_chars * 10 ** rng.random())
        docs.append(text[at:at + n])
        at += n
    return docs


def write_corpus(folder: Path, docs: list[str], vocab: int) -> list[int]:
    """The documents as a saved ``DatasetDict`` (``train``), and a BPE tokenizer trained on
    them (its end-of-text token pads) in ``folder/tokenizer``; the documents' token counts."""
    import datasets
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(docs, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>",
                            pad_token="<|endoftext|>").save_pretrained(folder / "tokenizer")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs})}).save_to_disk(
        str(folder / "data"))
    return [len(e.ids) for e in tokenizer.encode_batch(docs)]


def model_of(vocab: int, seq_len: int, width: int, layers: int, device: torch.device) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=width, n_layer=layers,
                        n_head=max(1, width // 64), bos_token_id=0, eos_token_id=0,
                        attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).to(device)
    model.loss_type = "ForCausalLM"
    return model


def side(folder: Path, pack: bool, args: argparse.Namespace, device: torch.device
         ) -> tuple[Callable[[], float], float]:
    """One side's measurement (real tokens per second over ``args.steps`` steps, after one
    warm-up step) and its loading seconds."""
    from trainkit.config import HFTextConfig
    from trainkit.core.runtime import Runtime
    from trainkit.data import load_data
    from trainkit.data.loader.resumable import pass_of
    from trainkit.data.sources.packing import real_tokens
    from trainkit.models.hf import hf_forward

    started = time.perf_counter()
    cfg = HFTextConfig(name="hf_text", root=str(folder / "data"), batch_size=args.batch,
                       tokenizer=str(folder / "tokenizer"), seq_len=args.seq_len, pack=pack,
                       num_workers=0, pin_memory=device.type == "cuda")
    loader = load_data(cfg, Runtime(device)).train
    load_s = time.perf_counter() - started
    model = model_of(args.vocab, args.seq_len, args.width, args.layers, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    precision = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
                 else torch.autocast("cpu", enabled=False))

    def batches() -> Iterator[Any]:
        epoch = 0
        while True:
            yield from pass_of(loader, epoch, 0)
            epoch += 1

    feed = batches()

    def step() -> torch.Tensor:
        batch = next(feed)
        with precision:
            loss = hf_forward(model, batch)[0].model_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return real_tokens(batch)

    step()

    def measure() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        tokens = sum(step() for _ in range(args.steps))
        count = int(tokens)  # waits for the device
        return count / (time.perf_counter() - start)

    return measure, load_s


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks it runs")
    parser.add_argument("--docs", type=int, default=800)
    parser.add_argument("--min-chars", type=int, default=150, help="shortest document's length")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="texts (padded) or windows")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8, help="steps per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.quick:
        args.docs, args.seq_len, args.width, args.layers, args.steps, args.rounds = (
            60, 128, 64, 1, 2, 1)
        args.min_chars = 40
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        lengths = sorted(write_corpus(folder, documents(args.docs, args.min_chars), args.vocab))
        padded, padded_load = side(folder, False, args, device)
        packed, packed_load = side(folder, True, args, device)
        samples = alternate({"padded": padded, "packed": packed}, args.rounds)
    value = ratio(samples, "packed", "padded")
    result = {
        "benchmark": "packing", "device": str(device),
        "settings": {k: v for k, v in vars(args).items() if k != "quick"},
        "padded_tokens_per_s": median(samples, "padded"),
        "packed_tokens_per_s": median(samples, "packed"),
        "doc_tokens": {"min": lengths[0], "p10": lengths[len(lengths) // 10],
                       "median": lengths[len(lengths) // 2],
                       "p90": lengths[len(lengths) * 9 // 10], "max": lengths[-1]},
        "load_s": {"padded": padded_load, "packed": packed_load},
        "rows": [row("packing (real tokens/s)", value, f">= {GOAL}x padded, lengths 10x",
                     None if args.quick else value >= GOAL)],
    }
    print(f"documents of {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}"
          f", cut to {args.seq_len})")
    print(f"real tokens/s on {device}: padded {result['padded_tokens_per_s']:.0f}, packed "
          f"{result['packed_tokens_per_s']:.0f}: {value:.2f}x (goal >= {GOAL}x; load "
          f"{padded_load:.1f} s padded, {packed_load:.1f} s packed)")
    emit(result)
    return result


if __name__ == "__main__":
    main()
