"""Where the epoch order lived: it is the loader's business now
(:mod:`trainkit.data.loader.resumable`). These names stay importable from here for code written
against the old home; new code imports them from the loader."""

from trainkit.data.loader.resumable import (
    ResumableBatchSampler,
    SeededBatch,
    check_shard,
    epoch_order,
    evaluation_sample,
    shard_size,
)

__all__ = ["ResumableBatchSampler", "SeededBatch", "check_shard", "epoch_order",
           "evaluation_sample", "shard_size"]
