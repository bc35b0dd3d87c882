"""What ``fedge agent status`` shows: one station's status, from its running agent or its file."""
