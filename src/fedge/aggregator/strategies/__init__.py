"""Flower strategies: streaming FedAvg, TiFL tiers, FedDF distillation, and their factory."""
