"""TLS: router-serve's HTTPS to its clients, client certificates (mTLS), and HTTPS to the engines.

Off unless `tls_cert_file` and `tls_key_file` name a certificate chain and its key (PEM): then the
API's address (and `admin_port`'s) serve HTTPS only, TLS 1.2 or later. The files are read again
when they change (checked every TLS_CHECK_S: a renewed certificate, or a Kubernetes Secret
swapped by its kubelet), into the same context, so new connections get the new certificate and
open ones keep theirs; a change that does not load (a write under way, a key that does not match)
keeps the certificate in force and is logged once. With `tls_client_ca_file` too, every client
must present a certificate that CA signed (mTLS), or its handshake fails.

HTTPS to the engines: a replica's URL that starts with `https://` is verified against the
system's CAs, or `replica_ca_file`'s alone; `replica_cert_file` and `replica_key_file` give the
router a client certificate to present (an engine that asks for one).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl

from router.config import ConfigError
from router.config.groups import TlsSettings

log = logging.getLogger("router.tls")

TLS_CHECK_S = 5.0  # how often the certificate's files are looked at for a change
Stamp = tuple[tuple[int, int, int], ...]


def _stamp(paths: tuple[str, ...]) -> Stamp:
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append((-1, -1, -1))
        else:
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class ServerTls:
    """The server's TLS context, its certificate read again when its files change."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str = "") -> None:
        self.cert_file, self.key_file = cert_file, key_file
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.reloads = 0
        self.rejected = 0
        self._stamp = _stamp((cert_file, key_file))
        self._refused: Stamp | None = None
        try:
            self.context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError("tls_cert_file", "config", f"cannot load {cert_file} with {key_file}: {exc}") from None
        if client_ca_file:
            try:
                self.context.load_verify_locations(client_ca_file)
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError("tls_client_ca_file", "config", f"cannot load {client_ca_file}: {exc}") from None
            self.context.verify_mode = ssl.CERT_REQUIRED

    def check(self) -> bool:
        """Read the certificate again if its files changed; True if the new one is in force."""
        stamp = _stamp((self.cert_file, self.key_file))
        if stamp == self._stamp or stamp == self._refused:
            return False
        try:
            # into a scratch context first: OpenSSL drops the key in force when a certificate that is
            # not its own is loaded, so a pair that does not load would leave the live context with none
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.cert_file, self.key_file)
            self.context.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            self._refused = stamp
            self.rejected += 1
            log.error(
                "router: TLS certificate %s not read again (%s); the one before stays in force", self.cert_file, exc
            )
            return False
        self._stamp, self._refused = stamp, None
        self.reloads += 1
        log.warning("router: TLS certificate read again from %s", self.cert_file)
        return True

    async def watch(self) -> None:
        """`check` every TLS_CHECK_S, until cancelled."""
        while True:
            await asyncio.sleep(TLS_CHECK_S)
            self.check()


def server_tls(config: TlsSettings) -> ServerTls | None:
    """The router's HTTPS, as its settings say (None: plain HTTP)."""
    if not config.tls_cert_file:
        return None
    return ServerTls(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)


def replica_context(config: TlsSettings) -> ssl.SSLContext | None:
    """The context HTTPS replicas are reached with; None: the system's default (its CAs, no client certificate)."""
    if not (config.replica_ca_file or config.replica_cert_file):
        return None
    try:
        context = ssl.create_default_context(cafile=config.replica_ca_file or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("replica_ca_file", "config", f"cannot load {config.replica_ca_file}: {exc}") from None
    if config.replica_cert_file:
        try:
            context.load_cert_chain(config.replica_cert_file, config.replica_key_file)
        except (OSError, ssl.SSLError) as exc:
            problem = f"cannot load {config.replica_cert_file} with {config.replica_key_file}: {exc}"
            raise ConfigError("replica_cert_file", "config", problem) from None
    return context


__all__ = ["TLS_CHECK_S", "ServerTls", "replica_context", "server_tls"]
