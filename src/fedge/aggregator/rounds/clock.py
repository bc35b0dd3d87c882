"""How long a party took: measured on the wall, or reported in virtual time.

In deployment a reply's latency is the wall time from push to pull. In simulation every
party reports ``virtual-time-s``: the time its work would have taken on its device
profile, so a 300-round comparison runs in minutes yet is timed like the real fleet.
"""

from enum import StrEnum

VIRTUAL_TIME_KEY = "virtual-time-s"


class ClockMode(StrEnum):
    WALL = "wall"
    VIRTUAL = "virtual"
