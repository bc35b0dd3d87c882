"""The fleet as operators run it: edges, deployments, predictions, views and watching."""
