"""Container healthchecks for docker/compose.yaml (the image has Python but no shell).

    python /opt/omnireduce/healthcheck.py tcp 127.0.0.1:5555       # the aggregator accepts connections
    python /opt/omnireduce/healthcheck.py file /tmp/x.alive 120    # touched within the last 120 s

Exit status 0 when healthy, 1 otherwise, with the reason on stderr.
"""

from __future__ import annotations

import os
import socket
import sys
import time


def check_tcp(target: str, timeout: float = 2.0) -> str | None:
    """Returns None when ``host:port`` accepts a TCP connection, else the reason."""
    host, _, port = target.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout).close()
    except (OSError, ValueError) as e:
        return f"cannot connect to {target}: {e}"
    return None


def check_file(path: str, max_age: float) -> str | None:
    """Returns None when ``path`` exists and was modified within ``max_age`` seconds, else the reason."""
    try:
        age = time.time() - os.stat(path).st_mtime
    except OSError as e:
        return f"no heartbeat: {e}"
    return None if age <= max_age else f"heartbeat {path} is {age:.0f} s old (limit {max_age:g} s)"


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "tcp":
        problem = check_tcp(argv[1])
    elif len(argv) in (2, 3) and argv[0] == "file":
        problem = check_file(argv[1], float(argv[2]) if len(argv) == 3 else 120.0)
    else:
        problem = "usage: healthcheck.py tcp HOST:PORT | file PATH [MAX_AGE_S]"
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
