"""One exit status scheme for every command, said in each command's --help and in
spark-guard(8). Before, a broken --config gave 1, 2 or 3 depending on the command, and
preflight's "unknown" was argparse's usage error.

    0  ok: it fits, nothing found, the guard runs, done
    1  the answer is no: it does not fit, a warning (or worse) was found, not done
    2  a usage or config error (argparse's own, a broken --config)
    3  status: the guard is not running (systemctl's 3); doctor: critical
    4  cannot say: a footprint unknown, no manager reached (nothing audited, no unit seen),
       NVML not there to ask
  141  (128 + SIGPIPE) the reader of stdout went away (`| head`), as with coreutils
"""

from __future__ import annotations

OK = 0
NO = 1
USAGE = 2
NOT_RUNNING = 3
CRITICAL = 3
CANNOT_SAY = 4

EPILOGS = {
    "check-config": "exit status: 0 valid, 1 invalid or a budget that cannot protect, 2 usage",
    "dump": "exit status: 0 shown, 1 /proc unreadable, 2 usage or config error, "
    "4 no systemd manager reached (no unit seen)",
    "preflight": "exit status: 0 it fits, 1 it does not fit, 2 usage or config error, "
    "4 cannot say (footprint unknown, model unreadable)",
    "audit": "exit status: 0 nothing found, 1 a warning or worse, 2 usage or config error, "
    "4 nothing audited (no systemd manager reached)",
    "status": "exit status: 0 running, 2 usage or config error, 3 not running, 4 state unreadable",
    "harden": "exit status: 0 done (or shown), 1 not done, 2 usage, config error or refused",
    "rescue": "exit status: 0 every loader held, 1 one not held or a manager not reached "
    "(or not root), 2 usage or config error",
    "doctor": "exit status: 0 healthy, 1 a warning, 2 usage or config error, 3 critical, "
    "4 cannot tell (NVML binding missing)",
    "release": "exit status: 0 released, 1 not released (a conflict, a failure), "
    "2 usage or config error",
    "run": "exit status: 0 stopped cleanly, 2 usage",
}
