"""The device stage: batches copied to the device ahead of use, decoded, checked, normalised."""
