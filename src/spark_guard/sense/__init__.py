"""Sense: one Snapshot per full look, from /proc, NVML, the managers and the engines.

sensor.py gathers it; managers.py keeps the connections to the systemd managers (made
off the loop); asking.py asks them a pass's questions (root's on the loop, first; the
users' in parallel off it, one turn for all of them); foresee.py says each loader's
footprint before it allocates; caches.py holds what outlives one reading of a unit or
a process. Who owns a process is core/attribution.py's to say, pure.
"""

from .sensor import Sensor, sense_once

__all__ = ["Sensor", "sense_once"]
