"""The manager's home directory and its long-running processes."""
