"""CURVE keys for the aggregator and its workers, and the ``omnireduce-keygen`` command.

ZeroMQ's CURVE mechanism encrypts every connection and authenticates both ends by
their key pairs. The aggregator holds a key pair (its ``.key_secret`` file) and,
optionally, a directory of the workers' public keys it accepts; a worker holds the
aggregator's public key and its own key pair. Key files are ZeroMQ certificates,
written by :func:`zmq.auth.create_certificates` and read by
:func:`zmq.auth.load_certificate`; the aggregator checks workers' keys with
:class:`zmq.auth.thread.ThreadAuthenticator`.

Typical setup::

    omnireduce-keygen keys aggregator                 # keys/aggregator.key, keys/aggregator.key_secret
    omnireduce-keygen keys/workers worker0 worker1    # one key pair per worker (or one shared by all)
    omnireduce-aggregator --curve-secret-key keys/aggregator.key_secret --curve-client-keys keys/workers
    OMNIREDUCE_CURVE_SERVER_KEY=keys/aggregator.key \\
    OMNIREDUCE_CURVE_CLIENT_KEY=keys/workers/worker0.key_secret  python train.py
"""

from __future__ import annotations

import argparse
import glob
import logging
import os
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from omnireduce.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "generate",
    "load_public_key",
    "load_key_pair",
    "configure_client",
    "configure_server",
    "start_authenticator",
    "main",
]

_Z85_KEY_CHARS = 40


def generate(directory: str | os.PathLike[str], name: str, overwrite: bool = False) -> tuple[Path, Path]:
    """Writes a new key pair: ``directory/name.key`` (public) and ``directory/name.key_secret``.

    Args:
        directory: created if missing.
        name: the files' base name.
        overwrite: replace existing files instead of refusing.

    Returns:
        The public and the secret file's paths.

    Raises:
        ConfigError: the files exist and ``overwrite`` is false, or the name is not a plain file name.
    """
    if not name or os.sep in name or name in (".", ".."):
        raise ConfigError(f"key name must be a plain file name, got {name!r}")
    root = Path(directory)
    public, secret = root / f"{name}.key", root / f"{name}.key_secret"
    if not overwrite and (public.exists() or secret.exists()):
        raise ConfigError(f"{public} or {secret} exists already (pass overwrite / --force to replace)")
    root.mkdir(parents=True, exist_ok=True)
    # The secret file must never be readable by others, not even for a moment: an old file
    # (its mode is kept by a write into it) goes first, so the secret is always a new file.
    for path in (public, secret):
        path.unlink(missing_ok=True)
    old = os.umask(0o077)
    try:
        pub_path, sec_path = zmq.auth.create_certificates(str(root), name)
    finally:
        os.umask(old)
    os.chmod(pub_path, 0o644)
    return Path(pub_path), Path(sec_path)


def load_public_key(value: str | os.PathLike[str]) -> bytes:
    """A CURVE public key from a certificate file, or from its 40-character Z85 text.

    Raises:
        ConfigError: no such file, not a certificate, or not a valid key.
    """
    text = os.fspath(value)
    if len(text) == _Z85_KEY_CHARS and not os.path.exists(text):
        try:
            if len(zmq.utils.z85.decode(text)) == 32:
                return text.encode("ascii")
        except (ValueError, KeyError, UnicodeEncodeError):
            pass
        raise ConfigError(f"{text!r} is neither a key file nor a Z85 CURVE public key")
    public, _ = _load(text)
    return public


def load_key_pair(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """The public and secret key of a ``.key_secret`` certificate file.

    Raises:
        ConfigError: no such file, not a certificate, or it holds no secret key.
    """
    public, secret = _load(os.fspath(path))
    if secret is None:
        raise ConfigError(f"{os.fspath(path)} holds no secret key: give the .key_secret file")
    return public, secret


def _load(path: str) -> tuple[bytes, bytes | None]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read CURVE key file {path!r}: {e}") from None
    if not public:
        raise ConfigError(f"{path!r} is not a ZeroMQ certificate (no public-key)")
    return public, secret


def configure_client(
    sock: zmq.Socket, server_key: str | os.PathLike[str], client_key: str | os.PathLike[str] | None
) -> None:
    """Turns CURVE on for a connecting socket, before it connects.

    Args:
        sock: the socket.
        server_key: the aggregator's public key (file or Z85 text).
        client_key: this side's ``.key_secret`` file; None makes a throwaway key pair,
            which only an aggregator that accepts any key lets in.
    """
    sock.curve_serverkey = load_public_key(server_key)
    public, secret = load_key_pair(client_key) if client_key is not None else zmq.curve_keypair()
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def configure_server(sock: zmq.Socket, secret_key: str | os.PathLike[str]) -> bytes:
    """Turns CURVE on for a binding socket, before it binds; returns the server's public key."""
    public, secret = load_key_pair(secret_key)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    return public


def start_authenticator(ctx: zmq.Context, client_keys: str | os.PathLike[str] | None) -> ThreadAuthenticator:
    """Starts the ZAP handler that admits CURVE clients of ``ctx``'s sockets.

    Args:
        ctx: the context of the server socket (one authenticator per context).
        client_keys: directory of the accepted clients' ``.key`` files; None accepts
            any client key (encryption without client authentication).

    Raises:
        ConfigError: the directory does not exist, or the handler cannot start.
    """
    location = zmq.auth.CURVE_ALLOW_ANY
    if client_keys is not None:
        location = os.fspath(client_keys)
        if not os.path.isdir(location):
            raise ConfigError(f"CURVE client key directory {location!r} does not exist")
        count = len(glob.glob(os.path.join(location, "*.key")))
        if count == 0:
            logger.warning("CURVE client key directory %s holds no .key file: every worker will be refused", location)
        else:
            logger.info("CURVE: accepting the %d worker key(s) in %s", count, location)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
    try:
        auth.start()
    except zmq.ZMQError as e:
        raise ConfigError(f"cannot start the CURVE authenticator (one per ZeroMQ context): {e}") from None
    auth.configure_curve(domain="*", location=location)
    return auth


def main(argv: list[str] | None = None) -> int:
    """``omnireduce-keygen DIR NAME...``: writes one CURVE key pair per name."""
    p = argparse.ArgumentParser(
        prog="omnireduce-keygen",
        description="Writes CURVE key pairs (DIR/NAME.key public, DIR/NAME.key_secret secret) for omnireduce.",
    )
    p.add_argument("directory", help="where to write the key files (created if missing)")
    p.add_argument("names", nargs="+", help="one key pair per name, e.g. aggregator worker0")
    p.add_argument("--force", action="store_true", help="replace existing key files")
    args = p.parse_args(argv)
    for name in args.names:
        try:
            public, secret = generate(args.directory, name, overwrite=args.force)
        except ConfigError as e:
            print(f"omnireduce-keygen: {e}")
            return 1
        print(f"{name}: public {public}  secret {secret}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
