"""What a checkpoint holds: flattening of nested state, value encoding, dtypes, RNG and data-position state."""
