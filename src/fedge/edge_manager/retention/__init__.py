"""Retention: reports kept for a while, deleted in bounded batches."""
