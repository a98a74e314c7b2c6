"""The commands' user errors as one short last line with an exit status (the run directory's
own logic is :mod:`trainkit.entry.run_dir`).

The library raises :class:`~trainkit.core.errors.TrainkitError` and names settings in its own
words (``run_dir``); here they become the Hydra override that sets them (``hydra.run.dir``).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import NoReturn

import torch
import torch.distributed
from hydra.errors import HydraException, InstantiationException
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from trainkit.core.errors import TrainkitError, chain_lines, one_line, print_error
from trainkit.core.schema import unknown_key_line
from trainkit.core.signals import EXIT_PREEMPTED, StoppedOutsideTraining
from trainkit.observe.logging import log_to_file

# Users who set HYDRA_FULL_ERROR=1 get full tracebacks; read before main() sets it for itself.
_SHOW_TRACEBACK = os.environ.get("HYDRA_FULL_ERROR") == "1"
# What the communication backends say when a peer process is gone or a collective timed out.
_BACKEND_ERROR = re.compile(r"gloo|nccl|c10d|ProcessGroup|(closed|reset) by peer", re.IGNORECASE)
# The library's words for settings the entry point sets through Hydra (a word of its own: a path
# that holds "run_dir" is left alone).
_HYDRA_WORDS = ((re.compile(r"(?<=\s)run_dir(?![\w/.-])"), "hydra.run.dir"),)


# How a stopped run resumes, for the abort line: the entry point sets the exact command where
# re-running the same one would start a new run dir (set_resume_hint).
_resume = ["re-run the same command to resume"]


def set_resume_hint(words: str) -> str:
    """Say ``words`` (``resume with: <command>``) where a line tells how to resume; returns them."""
    _resume[0] = words
    return words


@contextlib.contextmanager
def errors_as_one_line() -> Iterator[None]:
    """Turn user errors into a short last line (details before it), also written to train.log."""
    try:
        yield
    except (TrainkitError, HydraException, OmegaConfBaseException) as err:
        if _SHOW_TRACEBACK:
            raise
        if isinstance(err, TrainkitError):
            _fail(hydra_words(str(err)), details=err.details)
        if isinstance(err.__cause__, TrainkitError):  # a `_target_` that said what is wrong
            _fail(hydra_words(str(err.__cause__)), details=err.__cause__.details)
        if isinstance(err, InstantiationException):  # a `_target_` that fails to import or build
            _fail(_instantiate_message(err), details=chain_lines(err.__cause__ or err))
        if isinstance(err, MissingMandatoryValue) and getattr(err, "full_key", None):
            _fail(_missing_message(str(err.full_key)))
        if "Could not override" in str(err) and (line := unknown_key_line(
                getattr(err.__cause__, "full_key", None) or "")):  # a typo'd key, without +
            _fail(line)
        _fail(f"config error: {_fold_hydra_message(err)}")
    except torch.cuda.OutOfMemoryError as err:  # before fit, which reports its own (status oom)
        if _SHOW_TRACEBACK:
            raise
        _fail(f"out of memory before training started: {one_line(err, 80)}; free the GPU "
              "(nvidia-smi shows who holds it) or use data.loader=dataloader")
    except RuntimeError as err:
        if _SHOW_TRACEBACK or not _from_collective(err):
            _log_traceback(err)
            raise
        # Another rank died (its own error is above) and took the collective with it.
        _fail("lost contact with another rank, which probably failed; see its error above",
              details=chain_lines(err), status=1)
    except StoppedOutsideTraining as stop:  # nothing to save yet; a requeue loop re-runs it
        _fail(stop.message, status=EXIT_PREEMPTED)
    except KeyboardInterrupt:  # a second Ctrl-C (or signal) while stopping: abort, no save
        if _SHOW_TRACEBACK:
            raise
        _fail(f"aborted without saving; {_resume[0]} from the last checkpoint", status=130)
    except Exception as err:  # a bug, not bad input: the traceback stays, and the log keeps it
        _log_traceback(err)
        raise


def _log_traceback(err: BaseException) -> None:
    """Write ``err``'s traceback to train.log once (the contexts nest: main and the Hydra job)."""
    if not getattr(err, "_trainkit_logged", False):
        log_to_file("".join(traceback.format_exception(err)).splitlines())
        err._trainkit_logged = True  # type: ignore[attr-defined]


def _fail(message: str, *, details: Sequence[str] = (), status: int = 2) -> NoReturn:
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = f"rank {os.environ.get('RANK', 0)}: " if world_size > 1 else ""
    lines = print_error(message, details, prefix=f"trainkit: {rank}")
    log_to_file(lines)  # the run's train.log, when this process writes one
    sys.exit(status)


def _from_collective(err: BaseException) -> bool:
    """Whether ``err`` says another rank is gone: a backend error, a timeout, a closed socket.

    Only with several processes, and only by what the error is -- one of torch.distributed's
    ``DistError`` kinds (backend, network, store, timeouts) or a backend's words (gloo and NCCL
    errors often surface as plain RuntimeErrors from autograd or DDP) -- never by where it was
    raised: ``fully_shard``'s NotImplementedError passes through torch.distributed's frames too.
    """
    if int(os.environ.get("WORLD_SIZE", 1)) <= 1:
        return False
    return isinstance(err, torch.distributed.DistError) or bool(_BACKEND_ERROR.search(str(err)))


def _instantiate_message(err: InstantiationException) -> str:
    """What went wrong building a config's ``_target_`` (its import or its call), and the fix."""
    text = str(err)
    key = (re.findall(r"full_key: (\S+)", text) or ["a config node"])[0]
    target = (re.findall(r"target '([^']+)'", text) or ["?"])[0]
    if "Error locating target" in text:
        return (f"cannot import {key}._target_={target}: check the name, and that its module is "
                "importable from here (installed, or on PYTHONPATH)")
    unexpected = re.findall(r"unexpected keyword argument '(\w+)'", text)
    if unexpected:
        return (f"{target} takes no argument '{unexpected[0]}' ({key}.{unexpected[0]}): drop it "
                f"with ~{key}.{unexpected[0]}, or give {key} a config group of its own")
    return f"config error: cannot build {key} ({target}); the error is above"


def _missing_message(key: str) -> str:
    """A required key (``???`` in its config) left unset: which, and how to set it."""
    value = "/path/to/your/data" if key == "data.root" else "..."
    return f"{key} is not set and has no default here: add {key}={value} to the command"


def _fold_hydra_message(err: BaseException) -> str:
    """Fold Hydra/OmegaConf's multi-line messages into one line, keeping what says how to fix."""
    text = str(err).split("Config search path")[0]
    parts: list[str] = []
    listing = False
    for line in (raw.strip() for raw in text.splitlines()):
        if not line:
            continue
        if parts and (parts[-1].endswith(":") or listing):
            parts[-1] += (", " if listing else " ") + line  # "options in 'exp':" then one a line
            listing = True
        else:
            parts.append(line)
            listing = False
    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException):
        first = str(cause).strip().splitlines()[0]
        key = getattr(cause, "full_key", None)
        parts.append(first + (f" (key: {key})" if key else ""))
    return "; ".join(parts)


def hydra_words(message: str) -> str:
    """``message`` with the library's names of settings replaced by their Hydra overrides."""
    for pattern, words in _HYDRA_WORDS:
        message = pattern.sub(words, message)
    return message
