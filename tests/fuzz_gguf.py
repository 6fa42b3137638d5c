"""atheris (libFuzzer) on the GGUF header reader: anything but a ModelFileError is a finding.

Run by tests/test_gguf.py with a bounded number of runs; by hand for longer:
    .venv/bin/python tests/fuzz_gguf.py -runs=1000000 [corpus dir]
The seed is a real header (SmolLM2's), so the fuzzer starts from valid input.
"""

import contextlib
import os
import sys
import tempfile

import atheris

with atheris.instrument_imports():
    from spark_guard.foresight.gguf import read_header
from spark_guard.foresight.modelfile import ModelFileError

FD, PATH = tempfile.mkstemp(suffix=".gguf")


def one_input(data: bytes) -> None:
    os.ftruncate(FD, 0)
    os.pwrite(FD, data, 0)
    with contextlib.suppress(ModelFileError):  # anything else is a crash libFuzzer reports
        read_header(PATH)


if __name__ == "__main__":
    try:
        atheris.Setup(sys.argv, one_input)
        atheris.Fuzz()
    finally:
        os.unlink(PATH)
