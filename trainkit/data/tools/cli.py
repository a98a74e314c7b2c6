"""``python -m trainkit.data``: fetch datasets where there is internet, check them anywhere.

    python -m trainkit.data download mnist cifar10 --root DIR
    python -m trainkit.data verify --root DIR            # every dataset found under DIR
    python -m trainkit.data verify cifar10 --root DIR    # this one must be there
    python -m trainkit.data tokenize FILES_OR_FOLDERS OUT_DIR --tokenizer bytes|gpt2
    python -m trainkit.data shards IMAGE_FOLDER OUT_DIR --samples-per-shard N

Copy DIR to the offline cluster and point ``data.root`` (or ``TRAINKIT_DATA_DIR``) at it.
``tokenize`` writes a token corpus (train.bin, val.bin, meta.json) for ``data=tokens``;
``shards`` webdataset shards and their shards.json for ``data=webdataset``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from trainkit.core.errors import TrainkitError, command_name, print_error
from trainkit.data.sources.tensors import MNIST_MD5, cifar10_files
from trainkit.data.tools.checksums import check_md5
from trainkit.data.tools.download import (
    CIFAR10_FOLDER,
    download_cifar10,
    download_error_lines,
    download_mnist,
)
from trainkit.data.tools.shard_writer import write_shards
from trainkit.data.tools.tokenize import TOKENIZERS, tokenize


def _mnist_files() -> tuple[Path, dict[str, str]]:
    return Path("MNIST") / "raw", dict(MNIST_MD5)


def _cifar10_files() -> tuple[Path, dict[str, str]]:
    return Path(CIFAR10_FOLDER), {**cifar10_files(True), **cifar10_files(False)}


# name -> (where its files go under the root and their official md5s, how to download it)
DATASETS: dict[str, tuple[Callable[[], tuple[Path, dict[str, str]]], Callable[[Path], None]]] = {
    "mnist": (_mnist_files, download_mnist),
    "cifar10": (_cifar10_files, download_cifar10),
}


def verify(root: Path, names: list[str]) -> list[str]:
    """Check each named dataset's files under ``root``; return one problem line per bad dataset.

    With no names, every dataset with a folder under ``root`` is checked (the others are listed
    as skipped, so that a missing one is not taken for a checked one), and finding none is a
    problem.
    """
    if not names:
        names = [n for n, (files, _) in DATASETS.items() if (root / files()[0]).is_dir()]
        if not names:
            return [f"no dataset found under {root} (looked for "
                    f"{', '.join(str(DATASETS[n][0]()[0]) for n in DATASETS)})"]
        for name in (n for n in DATASETS if n not in names):
            print(f"{name}: skipped, no {root / DATASETS[name][0]()[0]} (`verify {name}` "
                  "requires it)")
    problems = []
    for name in names:
        folder, md5s = DATASETS[name][0]()
        missing = [f for f in md5s if not (root / folder / f).is_file()]
        if missing:
            problems.append(f"{name}: {root / folder} lacks {', '.join(missing)}")
            continue
        try:
            for file, md5 in md5s.items():
                check_md5(root / folder / file, md5, remembered=False)
        except TrainkitError as err:
            problems.append(f"{name}: {err}")
            continue
        print(f"{name}: ok ({len(md5s)} files in {root / folder} match the official checksums)")
    return problems


def _parser() -> argparse.ArgumentParser:
    """The command line: download, verify, tokenize, shards."""
    parser = argparse.ArgumentParser(prog=command_name("trainkit.data"),
                                     description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    default_root = os.environ.get("TRAINKIT_DATA_DIR", "./data")
    down = sub.add_parser("download", help="download datasets (needs internet)")
    down.add_argument("names", nargs="+", choices=sorted(DATASETS))
    down.add_argument("--root", default=default_root, help="default: $TRAINKIT_DATA_DIR or ./data")
    check = sub.add_parser("verify", help="check the files against the official checksums")
    # no `choices` here: argparse (3.11) checks an empty list against them and fails
    check.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(DATASETS)}")
    check.add_argument("--root", default=default_root, help="default: $TRAINKIT_DATA_DIR or ./data")
    tok = sub.add_parser("tokenize", help="text files to train.bin/val.bin (data=tokens)")
    tok.add_argument("inputs", nargs="+", type=Path, help="text files or folders of them")
    tok.add_argument("out_dir", type=Path, help="where train.bin, val.bin, meta.json go")
    tok.add_argument("--tokenizer", default="bytes", choices=TOKENIZERS,
                     help="bytes: each byte a token; gpt2: GPT-2's BPE (needs tiktoken)")
    tok.add_argument("--val-fraction", type=float, default=0.1,
                     help="the corpus's last tokens kept for validation (default 0.1)")
    tok.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"])
    shards = sub.add_parser("shards", help="an image folder to webdataset shards "
                                           "(data=webdataset)")
    shards.add_argument("folder", type=Path, help="train/<class>/ (and val/<class>/) images")
    shards.add_argument("out_dir", type=Path, help="where the shards and shards.json go")
    shards.add_argument("--samples-per-shard", type=int, default=1000)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command of ``python -m trainkit.data``; the exit status (2: a problem)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "tokenize":
        return _tokenize(args)
    if args.command == "shards":
        return _shards(args)
    unknown = [n for n in args.names if n not in DATASETS]
    if unknown:
        parser.error(f"unknown dataset {', '.join(unknown)}: use {', '.join(DATASETS)}")
    root = Path(args.root)
    if args.command == "download":
        for name in args.names:
            try:
                DATASETS[name][1](root)
            except Exception as err:  # offline, proxy, disk: the error chain, then one line
                print_error(f"{name}: download failed (offline? a proxy? see above): run this "
                             "where there is internet and copy the folder here",
                             download_error_lines(err))
                return 2
    problems = verify(root, args.names)
    for problem in problems:
        print_error(problem)
    return 2 if problems else 0


def _tokenize(args: argparse.Namespace) -> int:
    try:
        corpus = tokenize(args.inputs, args.out_dir, args.tokenizer, args.val_fraction,
                          args.dtype)
    except TrainkitError as err:
        print_error(str(err), err.details)
        return 2
    print(f"{args.out_dir}: {corpus.train_tokens} training and {corpus.val_tokens} validation "
          f"tokens from {corpus.files} files; train with +exp=lm data.root={args.out_dir}")
    return 0


def _shards(args: argparse.Namespace) -> int:
    try:
        index = write_shards(args.folder, args.out_dir, args.samples_per_shard)
    except TrainkitError as err:
        print_error(str(err), err.details)
        return 2
    counts = ", ".join(f"{len(index[s])} {s} shards ({sum(e['samples'] for e in index[s])} "
                       "samples)" for s in ("train", "val") if s in index)
    print(f"{args.out_dir}: {counts}, {len(index['classes'])} classes; train with "
          f"data=webdataset data.root={args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
