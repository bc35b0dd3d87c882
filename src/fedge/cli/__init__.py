"""The ``fedge`` command: wiring only -- parse, build a config object, call the library, render."""
