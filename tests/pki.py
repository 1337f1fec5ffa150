"""Certificates made in the test: a CA, a daemon certificate for 127.0.0.1, client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class Pki:
    ca: Path  # PEM of the CA that signed the daemon's and the client's certificates
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_cert: Path  # a client certificate signed by another CA
    rogue_key: Path


def make_pki(directory: Path, server_names: tuple[str, ...] = ()) -> Pki:
    """`server_names`: DNS names the daemon's certificate carries besides 127.0.0.1 and localhost."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("kvstore test CA")
    rogue_ca_key, rogue_ca_cert = _ca("someone else's CA")
    paths = {"ca": _write_cert(directory / "ca.pem", ca_cert)}
    for name, issuer_key, issuer, server in (("server", ca_key, ca_cert, True), ("client", ca_key, ca_cert, False),
                                             ("rogue", rogue_ca_key, rogue_ca_cert, False)):
        key, cert = _leaf(name, issuer_key, issuer, server, server_names)
        paths[f"{name}_cert"] = _write_cert(directory / f"{name}.pem", cert)
        paths[f"{name}_key"] = directory / f"{name}.key"
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
        paths[f"{name}_key"].write_bytes(pem)
    return Pki(**paths)


def _ca(name: str):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (_builder(subject, subject, key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(name: str, issuer_key, issuer: x509.Certificate, server: bool, server_names: tuple[str, ...] = ()):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"kvstore {name}")])
    builder = (_builder(subject, issuer.subject, key.public_key())
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                              critical=False)
               .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server
                                                     else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost"),
             *(x509.DNSName(n) for n in server_names)]), critical=False)
    return key, builder.sign(issuer_key, hashes.SHA256())


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1)))


def _write_cert(path: Path, cert: x509.Certificate) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path
