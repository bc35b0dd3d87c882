"""Sweeps on the simulated fleet (issue 31 item 5, Katib-style): :mod:`.spec` reads what
to search, :mod:`.manifests` writes each trial's job and the best as a fleet job, and
:mod:`.run` drives Optuna with the trials queued as BE jobs on the scheduler."""
