"""The job scheduler: many fleet jobs on one fleet's training stations (issue 31).

A pure core: :mod:`.queue` holds the frozen values (jobs, stations, what is queued and
what runs), :mod:`.windows` says when a station may train, :mod:`.policy` chooses which
best-effort jobs to suspend (FitGpp, LRTP, RAND, or none for FIFO) and :mod:`.decide`
turns a snapshot of the fleet into actions (start, suspend, resume). Adapters -- the
manager's store, the fleet-job runner, the benchmark's virtual clock -- call
:func:`.decide.decide` and carry the actions out; the core never does I/O.
"""
