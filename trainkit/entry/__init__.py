"""The commands (train, evaluate, predict, export, probe, ...); build.py and errors.py: theirs."""
