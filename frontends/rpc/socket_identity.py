"""Who is on the other end of a Unix socket, and where the default socket lives.

The kernel reports the peer process of a connected Unix socket (SO_PEERCRED): the server records each
client's pid and uid, and a client checks that the server it reached runs as the expected user before
sending a prompt. The default socket sits in a directory only its user can enter
($XDG_RUNTIME_DIR/spekula/, else /tmp/spekula-<uid>/, mode 0700), so another user cannot squat the
path; a directory that exists with another owner or open permissions is refused, not used.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import tempfile
from dataclasses import dataclass

from spekula.core.errors import SpekulaError

SOCKET_NAME = "spekula.sock"


class SocketIdentityError(SpekulaError):
    """The socket or its directory belongs to someone else, or the peer is not who it should be."""


@dataclass(frozen=True, slots=True)
class PeerCred:
    pid: int
    uid: int
    gid: int


def peer_credentials(sock: socket.socket) -> PeerCred | None:
    """The connected peer's pid/uid/gid, or None where the platform cannot tell."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
    except OSError:
        return None
    pid, uid, gid = struct.unpack("3i", raw)
    return PeerCred(pid, uid, gid)


def default_socket_dir() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return os.path.join(runtime, "spekula")
    return os.path.join(tempfile.gettempdir(), f"spekula-{os.getuid()}")


def default_socket_path() -> str:
    return os.path.join(default_socket_dir(), SOCKET_NAME)


def check_private_dir(path: str, *, create: bool) -> None:
    """The directory must be ours and closed to everyone else (created 0700 when `create`)."""
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            raise SocketIdentityError(f"cannot create socket directory {path}: {exc.strerror}") from None
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SocketIdentityError(f"socket directory {path} does not exist (is the server running?)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SocketIdentityError(f"{path} is not a directory; refusing to use it for the socket")
    if st.st_uid != os.getuid():
        raise SocketIdentityError(f"socket directory {path} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}); "
                                  "refusing to use it")
    if st.st_mode & 0o077:
        raise SocketIdentityError(f"socket directory {path} is open to other users (mode {stat.S_IMODE(st.st_mode):o}); "
                                  "refusing to use it (chmod 700 it, or choose another --socket)")


def verify_server(sock: socket.socket, path: str, expected_uid: int | None) -> PeerCred | None:
    """Refuse a server that does not run as `expected_uid` (None: accept any) before anything is sent."""
    cred = peer_credentials(sock)
    if expected_uid is None:
        return cred
    if cred is not None and cred.uid != expected_uid:
        raise SocketIdentityError(
            f"{path} is served by uid {cred.uid} (pid {cred.pid}), not by uid {expected_uid}; refusing to send "
            "anything (pass server_uid=<uid> to trust that server)")
    try:
        owner = os.stat(path).st_uid
    except OSError:
        owner = None
    if owner is not None and owner != expected_uid:
        raise SocketIdentityError(f"{path} belongs to uid {owner}, not to uid {expected_uid}; refusing to send anything")
    return cred
