"""`make demo`: a whole fleet on one machine, end to end (orchestration, not simulation)."""
