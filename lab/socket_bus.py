"""A socket unit's service that poses as its user's manager, run by a hostile user.

    python3 socket_bus.py LOG [DELAY]

Started by her manager for a `.socket` unit whose ListenStream= is where her
manager's private socket is (issue 40, H4): SO_PEERCRED then names her real
manager, which made the listener. With Accept=no it is handed the listener
(fd 3, LISTEN_FDS) and accepts; with Accept=yes (StandardInput=socket) fd 0
is the one connection. It answers the D-Bus handshake at once and, like the
attack, would answer a call only after DELAY seconds; every call it is sent
is written to LOG, so a test sees whether the guard asked it anything.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time


def serve(conn: socket.socket, log: str, delay: float) -> None:
    with conn:
        conn.settimeout(60)
        try:
            first = conn.recv(4096)
            if not first.startswith(b"\0AUTH"):
                return
            conn.sendall(b"OK 0123456789abcdef0123456789abcdef\r\n")
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                rest = data.split(b"BEGIN\r\n", 1)[-1]
                if rest:
                    with open(log, "a") as f:
                        f.write(f"call {len(rest)} bytes\n")
                    time.sleep(delay)
        except OSError:
            return


def main() -> None:
    log = sys.argv[1]
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 4.5
    if os.environ.get("LISTEN_FDS"):
        listener = socket.socket(fileno=3)
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=serve, args=(conn, log, delay), daemon=True).start()
    serve(socket.socket(fileno=0), log, delay)


if __name__ == "__main__":
    main()
