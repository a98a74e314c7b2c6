"""Several processes: process group and votes, DDP/FSDP wrapping, launcher, hang watchdog."""
