"""Round mechanics: push and pull, replies, streaming folds, deadlines, staleness, latency."""
