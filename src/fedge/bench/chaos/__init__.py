"""A fault-injection and soak suite for the fleet (issue 9): ``fedge bench chaos``.

Real processes -- Mosquitto, ``fedge manager serve``, N ``fedge agent run`` -- stream
predictions and labels while an operator pushes thresholds and deployments and a seeded
schedule injects faults; after a heal phase every invariant is checked.

- :mod:`~fedge.bench.chaos.schedule`: the pure, seeded fault schedule.
- :mod:`~fedge.bench.chaos.proxy`: a TCP proxy per agent (pass, drop, stall, truncate).
- :mod:`~fedge.bench.chaos.plant`: the processes, stations (some on a small tmpfs) and
  their files.
- :mod:`~fedge.bench.chaos.load`: stations scoring/labelling, the operator's changes.
- :mod:`~fedge.bench.chaos.injector`: faults applied to the plant; the hang watchdog.
- :mod:`~fedge.bench.chaos.invariants`: the pure end check.
- :mod:`~fedge.bench.chaos.clock`: wall-clock steps for agents (a ``sitecustomize`` shim).
- :mod:`~fedge.bench.chaos.runner`: the phases; :mod:`~fedge.bench.chaos.report` the JSON.
"""

from fedge.bench.chaos.runner import run_chaos

__all__ = ["run_chaos"]
