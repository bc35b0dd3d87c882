"""The fleet's control plane: model registry, desired configuration, deployments, ingest."""
