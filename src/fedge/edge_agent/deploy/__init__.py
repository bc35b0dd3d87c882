"""The station's models: deployed, restored at start-up, on probation, rolled back."""
