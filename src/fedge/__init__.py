"""fedge: federated, edge-to-cloud learning for factory fleets."""

__version__ = "0.1.0"
