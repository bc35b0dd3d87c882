"""Reads of what happened: reports, benchmarks, the closed loop's timeline."""
