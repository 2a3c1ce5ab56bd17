"""Unix-socket addresses, as gRPC spells them (`unix:/abs/path`), for services on one machine.

`kvmesh serve` puts its internal services on sockets in a private 0700 directory instead of
loopback ports: a port is free for any local user to bind while its service restarts, and whoever
holds it then receives the callers' bearer tokens; a socket in that directory can be neither
created nor reached by anyone else. The multi-host path keeps host:port.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

SCHEME = "unix:"
# sun_path holds 108 bytes on Linux, the last for the terminating NUL.
MAX_PATH_BYTES = 107


def socket_path(address: str) -> Path | None:
    """The socket of a `unix:` address (`unix:/abs/path` or `unix:///abs/path`); None for host:port."""
    if not address.startswith(SCHEME):
        return None
    path = address[len(SCHEME):]
    if path.startswith("//"):
        path = path[2:]
    if not path.startswith("/"):
        raise ValueError(f"a unix: address names an absolute path, got {address!r}")
    return Path(path)


def unix_address(path: Path) -> str:
    """The gRPC address of the socket at `path`."""
    return f"{SCHEME}{path.absolute()}"


def check_path_length(path: Path) -> Path:
    """`path`, or ValueError when it is longer than a Unix socket's name may be."""
    if len(os.fsencode(path.absolute())) > MAX_PATH_BYTES:
        raise ValueError(f"a Unix socket's path may have at most {MAX_PATH_BYTES} bytes: {path} is longer "
                         "(use a shorter $TMPDIR or $XDG_RUNTIME_DIR)")
    return path


def remove_stale_socket(path: Path) -> None:
    """Remove the socket a previous process left at `path` (a service restarted by `kvmesh serve`
    binds the same path again); anything but a socket there is not ours to remove: FileExistsError."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise FileExistsError(f"{path} exists and is not a socket: refusing to listen there")
    path.unlink(missing_ok=True)
