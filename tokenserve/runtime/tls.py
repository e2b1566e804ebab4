"""TLS for every gRPC (and the gateway's HTTP) listener and every channel between services.

One set of files per process, both directions:

    --tls-cert / --tls-key   serve TLS with this certificate; also presented as the client
                             certificate on outgoing channels (mutual TLS)
    --tls-ca                 verify the servers this process calls (outgoing channels are TLS
                             when given) and the client certificates callers present
    --tls-client-auth require   refuse callers without a client certificate signed by --tls-ca

    tls = TlsConfig(cert_file=..., key_file=..., ca_file=..., client_auth="require")
    server.add_secure_port(address, tls.server_credentials())
    grpc.aio.secure_channel(target, tls.channel_credentials())

No flag: plaintext, as before. The metrics endpoints stay plaintext HTTP.
"""
from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

CLIENT_AUTH = ("none", "require")


def _readable(flag: str, path: str | None) -> None:
    if path is not None and not Path(path).is_file():
        raise ValueError(f"{flag}: no such file {path!r}")


@dataclass(frozen=True)
class TlsConfig:
    """TLS files of one process (all None: plaintext)."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    # "require": callers must present a client certificate signed by ca_file (mutual TLS).
    client_auth: str = "none"

    def __post_init__(self):
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if self.client_auth not in CLIENT_AUTH:
            raise ValueError(f"--tls-client-auth must be one of {CLIENT_AUTH}, got {self.client_auth!r}")
        if self.client_auth == "require" and (self.ca_file is None or self.cert_file is None):
            raise ValueError("--tls-client-auth require needs --tls-cert, --tls-key and --tls-ca"
                             " (the CA that signs the callers' certificates)")
        _readable("--tls-cert", self.cert_file)
        _readable("--tls-key", self.key_file)
        _readable("--tls-ca", self.ca_file)

    @property
    def serves_tls(self) -> bool:
        """This process's listeners speak TLS."""
        return self.cert_file is not None

    @property
    def dials_tls(self) -> bool:
        """This process's outgoing channels speak TLS (verifying servers with ca_file)."""
        return self.ca_file is not None

    def _read(self, path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.serves_tls:
            raise ValueError("no --tls-cert: nothing to serve TLS with")
        return grpc.ssl_server_credentials(
            [(self._read(self.key_file), self._read(self.cert_file))],
            root_certificates=self._read(self.ca_file),
            require_client_auth=self.client_auth == "require")

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """Credentials for outgoing channels (None: plaintext); the certificate, when given,
        goes along as the client certificate."""
        if not self.dials_tls:
            return None
        return grpc.ssl_channel_credentials(root_certificates=self._read(self.ca_file),
                                            private_key=self._read(self.key_file),
                                            certificate_chain=self._read(self.cert_file))

    def uvicorn_kwargs(self) -> dict:
        """uvicorn.Config arguments for the same certificate on an HTTP listener."""
        if not self.serves_tls:
            return {}
        kw = {"ssl_certfile": self.cert_file, "ssl_keyfile": self.key_file}
        if self.ca_file:
            kw["ssl_ca_certs"] = self.ca_file
        if self.client_auth == "require":
            kw["ssl_cert_reqs"] = ssl.CERT_REQUIRED
        return kw


PLAINTEXT = TlsConfig()


def add_tls_args(parser, *, serving: bool = True) -> None:
    """The TLS flags every service shares (see the module docstring); `serving=False`: only
    the client side (a probe, tsctl)."""
    g = parser.add_argument_group("TLS (default: plaintext)")
    if not serving:
        g.add_argument("--tls-ca", default=None,
                       help="CA certificate (PEM) of the servers called: connect with TLS")
        g.add_argument("--tls-cert", default=None,
                       help="client certificate (PEM) for servers that require one")
        g.add_argument("--tls-key", default=None, help="the private key of --tls-cert (PEM)")
        return
    g.add_argument("--tls-cert", default=None,
                   help="serve TLS with this certificate (PEM); also the client certificate"
                        " presented on outgoing channels")
    g.add_argument("--tls-key", default=None, help="the private key of --tls-cert (PEM)")
    g.add_argument("--tls-ca", default=None,
                   help="CA certificate (PEM) that verifies the servers this service calls"
                        " (outgoing channels use TLS when given) and callers' client certificates")
    g.add_argument("--tls-client-auth", choices=CLIENT_AUTH, default="none",
                   help="require: refuse callers without a client certificate signed by --tls-ca")


def tls_from_args(a) -> TlsConfig:
    """The TlsConfig of parsed add_tls_args flags (ValueError when they do not fit together)."""
    return TlsConfig(cert_file=a.tls_cert, key_file=a.tls_key, ca_file=a.tls_ca,
                     client_auth=getattr(a, "tls_client_auth", "none"))
