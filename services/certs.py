"""A private CA and certificates for a mesh (``specmesh certs``; tests use it too).

One CA signs one certificate per name; each certificate is valid for TLS server *and*
client authentication, so the same files serve a tier's port and its mTLS calls.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path
    ca: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_ca(out: Path, name: str = "SpecMesh CA", days: int = 365) -> tuple[Path, Path]:
    """Writes ``ca.pem`` and ``ca-key.pem`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    (out / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, out / "ca-key.pem")
    return out / "ca.pem", out / "ca-key.pem"


def make_cert(out: Path, name: str, hosts: list[str], days: int = 365) -> CertFiles:
    """Writes ``{name}.pem`` and ``{name}-key.pem`` signed by the CA in ``out``; the
    certificate names ``hosts`` (DNS names or IP addresses)."""
    if not hosts:
        raise ValueError("a certificate needs at least one host name or IP address")
    ca_cert = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((out / "ca-key.pem").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(_san(hosts), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, out / f"{name}-key.pem")
    return CertFiles(cert=out / f"{name}.pem", key=out / f"{name}-key.pem", ca=out / "ca.pem")
