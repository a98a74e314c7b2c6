"""What every layer uses: runtime, device, RNG, trees, errors, signals, LR schedules."""
