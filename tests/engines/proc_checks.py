"""Process and port checks shared by the engine tests (imported as `from proc_checks import ...`)."""

import socket
from pathlib import Path


def running(pid: int) -> bool:
    """True if `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rfind(")") + 2] not in "ZX"


def port_free(port: int) -> bool:
    """Nothing listens on `port` and a server could bind it (SO_REUSEADDR, as servers do: TIME_WAIT is fine)."""
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            return False
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True
