"""The federated jobs prepared for this fleet (``fleet_jobs``): what the console lists.

The job itself lives in its own directory and run store (aggregator/jobs/run_store.py); the
manager keeps only where it is, its name and model, and when it was prepared.
"""

from fedge.edge_manager.store import Store


def record(store: Store, job_dir: str, name: str, model: str, now: float) -> None:
    """A job prepared for this fleet (again: the newer preparation replaces the row)."""
    store.conn.execute(
        "INSERT OR REPLACE INTO fleet_jobs (job_dir, name, model, prepared_at) VALUES (?,?,?,?)",
        (job_dir, name, model, now),
    )
