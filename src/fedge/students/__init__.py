"""Compact edge models distilled from a teacher and published to the registry.

Above the simulator (they distil on its data partitions and generated defect images) and
the manager (they publish): the pure model families and distillation stay in models/.
"""
