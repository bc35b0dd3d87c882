"""Server-side privacy of a round: central DP (clipping + noise) and SecAgg+."""
