"""The station's images, shown to an operator on demand (issue 30, item 3)."""
