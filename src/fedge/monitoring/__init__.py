"""Watching a serving model without labels: image and score features, drift, MPP."""
