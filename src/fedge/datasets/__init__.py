"""Data sets the project generates itself: synthetic inspection surfaces and line conditions.

Below everything that uses them (models, students, the simulator, the demo, benches):
nothing here knows who trains on it."""
