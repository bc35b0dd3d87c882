"""Anomaly jobs (issue 28): the fleet's good-part statistics added into one model.

One message per station, no epochs: :mod:`.combine` is the pure sum and fit,
:mod:`.server` the Flower ``ServerApp`` around it, :mod:`.rounds` a fleet job's round,
:mod:`.spec` its manifest and :mod:`.secure` SecAgg+'s ranges and the bound they keep.
"""
