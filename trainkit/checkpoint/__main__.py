"""``python -m trainkit.checkpoint consolidate <run>/checkpoints/step_<N> out.pt [--optimizer]``.

Writes a sharded (FSDP) checkpoint directory as one plain file with ``model`` (the unwrapped
model's state_dict), ``global_step`` and ``epoch`` (and, with ``--optimizer``, the optimizer's
state keyed by parameter name), for inference and sharing: it loads with
``torch.load(out, weights_only=True)`` and ``model.load_state_dict(state["model"])``. Runs in one
process, without torchrun. Exit status: 0 when written, 2 on bad input (nothing written).
"""

from __future__ import annotations

import argparse
import sys

from trainkit.core.errors import TrainkitError, command_name, print_error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=command_name("trainkit.checkpoint"),
                                     description="Tools for trainkit checkpoints.")
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="a sharded checkpoint directory as one file")
    merge.add_argument("source", help="a checkpoint directory, e.g. <run>/checkpoints/last, "
                       "or a commit record's URL, e.g. s3://bucket/run/last.json")
    merge.add_argument("out", help="the file to write, e.g. model.pt")
    merge.add_argument("--optimizer", action="store_true", help="include the optimizer's state")
    args = parser.parse_args(argv)
    from trainkit.checkpoint.consolidate import consolidate  # torch.distributed: after --help

    try:
        out = consolidate(args.source, args.out, optimizer=args.optimizer)
    except TrainkitError as err:
        print_error(str(err))
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
