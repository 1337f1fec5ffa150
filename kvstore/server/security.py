"""The daemon's security settings made live: tokens, TLS for gRPC and for the data channel.

Both ports use the same certificate and, with `tls_client_ca`, both require a client certificate that
CA signed (mutual TLS). A daemon that listens beyond loopback without tokens or without TLS says so
loudly at start-up: anyone who can reach the port could read, overwrite or delete blocks, or sniff tokens.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass

import grpc

from kvstore.server.auth import Authenticator
from kvstore.server.config import ServerConfig
from kvstore.server.grpc_auth import TokenInterceptor

log = logging.getLogger("kvstore.server")


@dataclass(frozen=True)
class Security:
    authenticator: Authenticator | None  # None: every caller may do everything (loopback development)
    grpc_credentials: grpc.ServerCredentials | None  # None: plaintext gRPC
    data_tls: ssl.SSLContext | None  # None: plaintext data channel

    @classmethod
    def from_config(cls, config: ServerConfig) -> Security:
        """Raises AuthConfigError (a bad token file) or ValueError (unreadable certificates)."""
        authenticator = Authenticator.from_file(config.auth_tokens) if config.auth_tokens else None
        credentials, context = None, None
        if config.tls_cert is not None and config.tls_key is not None:  # the config has both or neither (tls)
            try:
                key, chain = config.tls_key.read_bytes(), config.tls_cert.read_bytes()
                client_ca = config.tls_client_ca.read_bytes() if config.tls_client_ca else None
                credentials = grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca,
                                                          require_client_auth=client_ca is not None)
                context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
                context.minimum_version = ssl.TLSVersion.TLSv1_2
                context.num_tickets = 0  # no resumption: clients pool long-lived connections instead
                context.load_cert_chain(config.tls_cert, config.tls_key)
                if config.tls_client_ca:
                    context.load_verify_locations(cafile=str(config.tls_client_ca))
                    context.verify_mode = ssl.CERT_REQUIRED
            except (OSError, ssl.SSLError) as exc:
                files = ", ".join(str(f) for f in (config.tls_cert, config.tls_key, config.tls_client_ca) if f)
                raise ValueError(f"cannot load the TLS certificate or key ({files}): {exc}") from None
        security = cls(authenticator, credentials, context)
        security.warn_if_exposed(config)
        return security

    @property
    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenInterceptor(self.authenticator)] if self.authenticator else []

    def warn_if_exposed(self, config: ServerConfig) -> None:
        if config.loopback_only:
            return
        if self.authenticator is None:
            log.warning("!" * 100)
            log.warning("kvstore-server listens on %s WITHOUT AUTHENTICATION: anyone who reaches it can read, "
                        "overwrite and delete every tenant's blocks. Set auth_tokens (and tls_cert/tls_key); "
                        "see docs/operations.md, 'Running a secured cluster'.", config.host)
            log.warning("!" * 100)
        elif self.data_tls is None:
            log.warning("kvstore-server listens on %s without TLS: tokens and KV bytes cross the network in clear. "
                        "Set tls_cert and tls_key.", config.host)
