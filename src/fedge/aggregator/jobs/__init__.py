"""Jobs any process can inspect, halt, amend and resume: directory, spec, checkpoints, run store."""
