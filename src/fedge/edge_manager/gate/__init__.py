"""The validation gate: stations evaluate a candidate, the gate decides whether it is blessed."""
