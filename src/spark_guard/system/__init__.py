"""The OS adapters: /proc, cgroupfs, the systemd managers, unit files, NVML, mlock, and
file access that never follows a user's link. What the guard reads and where it writes;
no judgement here."""
