"""The station's signed configuration: verified, decided, kept, and what it carries."""
