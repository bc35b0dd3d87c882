"""Staged rollouts: the pure state machine, its plan and health, the store, the driver."""
