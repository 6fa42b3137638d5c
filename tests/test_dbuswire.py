"""A user's unit properties, read bounded: dbuswire against a real systemd --user.

pystemd reads a reply whole with the GIL held; a user's unit with 60
Environment= lines of 1 MB each cost the guard 134 MiB and half a second (and
systemd 3.7 s to send). Here the reply's header is read first, a reply over the
cap is refused unread, the whole call has a deadline, and only the variables
foresight reads are kept.
"""

from __future__ import annotations

import struct
import time

import pytest

from lab.harness import UserManager
from spark_guard.core.argv.environment import needed
from spark_guard.system import dbuswire
from spark_guard.system.managers import DETAILS_CAP, DETAILS_TIMEOUT, ManagerError, connect_to


def test_only_what_foresight_reads_is_kept():
    env = [
        "LLAMA_ARG_CTX_SIZE=8192",
        "OLLAMA_MODELS=/srv/ollama",
        "HOME=/home/a",
        "MODEL_ID=meta/llama",
        "MY_MODEL=/m/x.gguf",
        "PAD=" + "x" * 100,
        "LLAMA_ARG_MODEL=" + "y" * 10_000,  # no setting is that long
        "noequals",
    ]
    assert needed(env, [("llama-server", "-m", "${MY_MODEL}")]) == (
        "LLAMA_ARG_CTX_SIZE=8192",
        "OLLAMA_MODELS=/srv/ollama",
        "HOME=/home/a",
        "MODEL_ID=meta/llama",
        "MY_MODEL=/m/x.gguf",
    )
    assert "MY_MODEL=/m/x.gguf" not in needed(env, [("llama-server", "-m", "/m/x.gguf")])


def test_a_malformed_reply_is_one_error_not_a_crash():
    body = struct.pack("<I", 1 << 30) + b"abc"  # a string that claims a gigabyte
    with pytest.raises(dbuswire.WireError, match="ends inside a value"):
        dbuswire.unmarshal("s", body, "<")
    with pytest.raises(dbuswire.WireError, match="array runs past"):
        dbuswire.unmarshal("as", struct.pack("<I", 1 << 20), "<")
    nested = "a" * 40 + "s"
    with pytest.raises(dbuswire.WireError, match="nested too deep"):
        dbuswire.unmarshal(nested, struct.pack("<I", 4) * 41, "<")


@pytest.mark.systemd
def test_a_users_huge_environment_is_refused_unread_and_a_real_unit_read_as_pystemd_does():
    big = "".join(f"Environment=PAD{i}={'x' * 200_000}\n" for i in range(4))
    huge = "".join(f"Environment=PAD{i}={'x' * 1_000_000}\n" for i in range(60))
    with UserManager() as um:
        um.write_unit(
            "llama-a.service",
            "[Service]\nExecStart=/bin/sleep 3600 -m '${MODEL}'\n"
            "Environment=LLAMA_ARG_CTX_SIZE=8192 MODEL=/m/x.gguf PAD=1 HOME=/h\nUser=nobody\n",
        )
        for name, env in (("llama-big", big), ("llama-huge", huge)):
            um.write_unit(f"{name}.service", f"[Service]\nExecStart=/bin/sleep 3600\n{env}")
            um.systemctl("start", f"{name}.service")  # loaded, as a running loader is
        m = connect_to("user:0", "/nonexistent", str(um.user_runtime))
        try:
            details = m.unit_details("llama-a.service")
            assert details.exec_start == (("/bin/sleep", "3600", "-m", "${MODEL}"),)
            assert details.environment == (
                "LLAMA_ARG_CTX_SIZE=8192",
                "MODEL=/m/x.gguf",
                "HOME=/h",
            )
            assert details.user == "nobody"
            # 800 kB: its size is in the reply's header, and nothing more is read.
            with pytest.raises(ManagerError, match=r"reading Environment: a reply of \d+ bytes"):
                m.unit_details("llama-big.service")
            # 60 MB: systemd takes seconds to send it; the deadline comes first.
            began = time.monotonic()
            with pytest.raises(
                ManagerError,
                match=r"reading Environment: (a reply of \d+ bytes|no answer within the deadline)",
            ):
                m.unit_details("llama-huge.service")
            assert time.monotonic() - began < DETAILS_TIMEOUT + 0.5
            # The connection the guard keeps is untouched: the next read answers.
            assert m.unit_details("llama-a.service") == details
        finally:
            m.close()
    assert DETAILS_CAP < 800_000
