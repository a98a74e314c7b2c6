"""``python -m trainkit.train``, kept at its documented path: the entry point is
:mod:`trainkit.entry.train`."""

from trainkit.entry.train import main, train

__all__ = ["main", "train"]

if __name__ == "__main__":
    main()
