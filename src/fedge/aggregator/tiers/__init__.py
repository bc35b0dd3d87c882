"""TiFL's tiers (Chai et al., HPDC'20): parties grouped by latency, and which tier trains next."""
