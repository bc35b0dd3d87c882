"""The monitor: drift and label-free accuracy per edge, alert rules and their store."""
