"""The machines the tests, demo/ and benchmarks/ build and drive.

Real systemd user managers and journald in private mount namespaces (harness),
unprivileged accounts (accounts), the guard as a unit beside loader units
(guardunit), fake user managers by the hundred (churn, fake_manager), Debian
containers with systemd as PID 1 (nspawn), a Debian VM under qemu (vm) and the
incident's layout in it (wedge, probe), stand-in loaders (fake_loader),
synthetic GGUF headers of big models (synth), real GGUF files (testdata) and
llama.cpp's own figures the estimate is held to (llamacpp).

Shared by the three, so none of demo/ or benchmarks/ imports the test suite.
Run from the checkout's root: `pytest`, `python -m benchmarks.NAME`,
`python -m demo.incident`. fake_loader.py, fake_manager.py and probe.py are also
run as scripts, by path (in units, containers and the VM): they import nothing
from here.
"""

from pathlib import Path

LAB = Path(__file__).resolve().parent
"""This folder: the scripts above are run from here by path."""
