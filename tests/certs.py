"""Certificates made in a test (the ``cryptography`` package): CAs and the certificates they
sign, written as PEM files the way a mounted Secret holds them, and rewritten to rotate."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Issued:
    cert: Path
    key: Path


@dataclass
class Ca:
    """A CA under ``root``: ``ca.crt`` is what verifiers are given."""

    root: Path
    name: str

    def __post_init__(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, self.name)])
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                      .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
                      .not_valid_before(now - datetime.timedelta(hours=1))
                      .not_valid_after(now + datetime.timedelta(days=1))
                      .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
                      .add_extension(x509.KeyUsage(
                          digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False), True)
                      .sign(self._key, hashes.SHA256()))
        self.crt = self.root / f"{self.name}.crt"
        self.crt.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, sans: tuple[str, ...] = ("DNS:localhost", "IP:127.0.0.1"), *,
              expired: bool = False, into: Path | None = None) -> Issued:
        """``name``.crt / ``name``.key (in ``into``, default the CA's directory) for
        ``sans`` (``DNS:x``, ``IP:x``, ``URI:x``), usable as server and client certificate.
        The files are replaced by rename, as the kubelet swaps a Secret's files."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        start, end = ((now - datetime.timedelta(days=2), now - datetime.timedelta(days=1))
                      if expired else (now - datetime.timedelta(hours=1),
                                       now + datetime.timedelta(days=1)))
        names: list[x509.GeneralName] = []
        for s in sans:
            kind, _, value = s.partition(":")
            names.append(x509.DNSName(value) if kind == "DNS" else
                         x509.IPAddress(ipaddress.ip_address(value)) if kind == "IP" else
                         x509.UniformResourceIdentifier(value))
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(self._cert.subject).public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName(names), False)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), False)
                .sign(self._key, hashes.SHA256()))
        d = into or self.root
        d.mkdir(parents=True, exist_ok=True)
        out = Issued(d / f"{name}.crt", d / f"{name}.key")
        _replace(out.key, key.private_bytes(serialization.Encoding.PEM,
                                            serialization.PrivateFormat.PKCS8,
                                            serialization.NoEncryption()))
        _replace(out.cert, cert.public_bytes(serialization.Encoding.PEM))
        return out


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
