"""Operators' labels: one current label per prediction, its history, the document sent down."""
