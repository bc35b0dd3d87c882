"""Fleet jobs: manifests, the job's server on the fleet's SuperLink, node identities, grids."""
