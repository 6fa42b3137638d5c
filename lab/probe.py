"""Runs inside the VM from early boot: one fork+exec of /bin/true every 100 ms, and MemAvailable.

One line per sample goes to /dev/ttyS1, the VM's second serial port, so the
host reads it even while the guest's sshd, journal or disk cannot answer:

    P <CLOCK_BOOTTIME s> <fork+exec+wait ms> <late ms> <MemAvailable KiB>

"late" is how far behind its 100 ms schedule the probe itself started the
sample: a probe that cannot even run is a stall too. Plain fork() on
purpose (not posix_spawn's vfork): sshd and a shell fork, and fork is what
fails or stalls when memory is gone.
"""

import os
import time

TICK = 0.1

out = os.open("/dev/ttyS1", os.O_WRONLY | os.O_NOCTTY)
meminfo = os.open("/proc/meminfo", os.O_RDONLY)


def available_kib() -> int:
    data = os.pread(meminfo, 4096, 0)
    start = data.index(b"MemAvailable:") + len(b"MemAvailable:")
    return int(data[start : data.index(b"kB", start)])


next_at = time.monotonic()
while True:
    late = max(time.monotonic() - next_at, 0.0)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            os.execv("/bin/true", ["true"])
        finally:
            os._exit(127)
    os.waitpid(pid, 0)
    took = time.monotonic() - t0
    now = time.clock_gettime(time.CLOCK_BOOTTIME)
    os.write(out, f"P {now:.3f} {took * 1e3:.1f} {late * 1e3:.1f} {available_kib()}\n".encode())
    next_at += TICK
    delay = next_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    else:
        next_at = time.monotonic()  # fell behind: the lateness is recorded, start afresh
