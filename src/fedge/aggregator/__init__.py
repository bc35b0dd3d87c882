"""Federated rounds: Flower strategies (tiered, deadline-aware), run store, jobs."""
