"""The ServerApp of a distill or nested fleet job: the aggregator's, handed the stations'
families.

A distill job's server distils every tier's architecture on its proxy set, and a nested
job's cuts each tier's architecture from the global model, so both build the stations'
model family at each named size (:func:`fedge.party.families.architectures`). The
aggregator's ServerApp (:mod:`fedge.aggregator.fleet.server`) cannot import the party's
families (one-way layers), so such a job's Flower app names this one, which runs the
same job with the family handed in.
"""

from __future__ import annotations

from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedge.aggregator.fleet.server import JOB_DIR_KEY, run_fleet_job
from fedge.aggregator.jobs.directory import JobError
from fedge.party.families import architectures

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the distill or nested fleet job whose directory the run config names
    (``job-dir``)."""
    job_dir = context.run_config.get(JOB_DIR_KEY)
    if not isinstance(job_dir, str) or not job_dir:
        raise JobError(f"run_config[{JOB_DIR_KEY!r}] must name a fleet job's directory")
    run_fleet_job(grid, Path(job_dir), architectures=architectures)
