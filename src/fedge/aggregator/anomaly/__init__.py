"""Anomaly jobs (issue 28): the fleet's good-part statistics added into one model.

One message per station, no epochs: :mod:`~fedge.aggregator.anomaly.combine` is the pure
sum and fit, :mod:`~fedge.aggregator.anomaly.server` the Flower ``ServerApp`` around it.
"""
