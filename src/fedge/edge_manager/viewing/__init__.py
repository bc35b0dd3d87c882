"""A station's image fetched on demand for an operator, never stored here (issue 30)."""
