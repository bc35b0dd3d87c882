"""``fedge manager doctor``: what in a manager home weakens the fleet's security."""
