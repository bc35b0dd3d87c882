"""Heterogeneous fleets simulated on one machine."""
