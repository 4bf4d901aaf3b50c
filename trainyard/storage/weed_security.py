"""SeaweedFS's own security for the embedded store: JWT signing keys and mutual-TLS
certificates, written as the `security.toml` that `weed -config_dir=...` reads.

Only the S3 port is meant for clients, and it checks the store's key pair. Every other port
`weed mini` opens (master, volume, filer, admin; HTTP and gRPC) serves its peers inside the
same process, so each requires a client certificate signed by this store's own CA, and the
volume and filer servers also want a JWT signed with keys only the process knows.

Everything is generated afresh at each start: the CA's private key is never written, so no
one can mint another accepted certificate, and a stale or half-written set cannot survive.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from trainyard.util.files import write_text_atomic

# JWT keys: master -> volume writes and reads; S3 gateway -> filer writes and reads.
JWT_SECTIONS = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
# Every gRPC server and client role SeaweedFS knows; a server whose section lacks a
# certificate would listen in plaintext, so none is left out.
GRPC_ROLES = (
    "master",
    "volume",
    "filer",
    "s3",
    "admin",
    "worker",
    "client",
    "msg_broker",
    "msg_agent",
    "mq",
)
HTTPS_SERVERS = ("master", "volume", "filer", "admin")
VALID_DAYS = 3650  # a store may run for years between restarts


def write_security_config(folder: Path, address: str = "127.0.0.1") -> Path:
    """Fresh keys, certificates and `security.toml` in `folder` (files 0600); returns it.
    `address`: the one the store serves on, which its parts also reach each other at."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    folder.chmod(0o700)
    ca_pem, cert_pem, key_pem = _certificates(address)
    files = {"ca.pem": ca_pem, "cert.pem": cert_pem, "key.pem": key_pem}
    for name, text in files.items():
        write_text_atomic(folder / name, text, private=True)
    toml = _security_toml(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    write_text_atomic(folder / "security.toml", toml, private=True)
    return folder


def _security_toml(ca: Path, cert: Path, key: Path) -> str:
    def section(name: str, **values: object) -> str:
        # JSON strings and booleans are valid TOML basic strings and booleans.
        body = "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
        return f"[{name}]\n{body}\n"

    paths = {"cert": str(cert), "key": str(key)}
    parts = [section(name, key=secrets.token_urlsafe(32)) for name in JWT_SECTIONS]
    parts += [
        # No unauthenticated status pages on the volume server or directory listings
        # in the filer's answers, whatever else is configured.
        section("access", ui=False),
        section("filer.expose_directory_metadata", enabled=False),
        section("grpc", ca=str(ca)),
        *(section(f"grpc.{role}", **paths) for role in GRPC_ROLES),
        # With `ca` set, each HTTPS server demands a client certificate from that CA.
        *(section(f"https.{name}", **paths, ca=str(ca)) for name in HTTPS_SERVERS),
        section("https.client", enabled=True, **paths, ca=str(ca)),
    ]
    return "".join(parts)


def _certificates(address: str) -> tuple[str, str, str]:
    """A throwaway CA's certificate, and one certificate and key it signed for every role:
    servers and clients alike, for 127.0.0.1, localhost and the served `address` (the HTTPS
    clients check names: the S3 gateway uploads to the volume server at that address)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("trainyard store CA")
    ca = (
        _builder(ca_name, ca_name, ca_key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    addresses = dict.fromkeys(["127.0.0.1", address])  # in order, once each
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in addresses]
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    cert = (
        _builder(_name("trainyard store"), ca_name, key.public_key(), now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    pem = serialization.Encoding.PEM
    return ca.public_bytes(pem).decode(), cert.public_bytes(pem).decode(), key_pem.decode()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject, issuer, public_key, now: datetime.datetime) -> x509.CertificateBuilder:
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        # A little slack for clocks that disagree by a few minutes.
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )
