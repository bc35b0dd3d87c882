"""Continuous training: when the fleet trains again, and the run from job to rollout."""
