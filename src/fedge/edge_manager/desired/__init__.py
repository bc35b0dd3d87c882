"""Desired documents: the next config and deployment decided, stored, published, kept fresh."""
