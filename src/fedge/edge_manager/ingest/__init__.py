"""Everything edges send up, checked and stored exactly once."""
