"""The model registry: immutable, signed model versions with lineage."""
