"""Signed bundles: OpenSSF model_signing over ``bundle.json`` (which holds every file's sha256), written as
``bundle.sig``; ``verify`` checks it with a public key and can require it. Keys are generated per test (elliptic
curve P-256, as model_signing's key signer expects); keyless Sigstore signing needs a network and is not run here."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import bundle
from pipeline.identity import ArtifactKey
from pipeline.errors import UserError
from tests.conftest import TINY, cli_env, report, run_cli
from tests.helpers.bundles import make_bundle, rewrite_manifest

pytest.importorskip("model_signing", reason="pip install -e '.[sign]' (OpenSSF model-signing)")


def _keypair(d: Path, name: str = "signer") -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    d.mkdir(parents=True, exist_ok=True)
    priv, pub = d / f"{name}.pem", d / f"{name}.pub.pem"
    priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    return priv, pub


def _sign_cfg(tmp_path: Path, *extra: str):
    from pipeline.hardware import compose  # target/runtime auto: this machine's, as the CLI composes

    return compose([*TINY, f"paths.root={tmp_path / 'root'}", *extra]).publish.sign


@pytest.fixture
def signed(tmp_path):
    """(a signed synthetic bundle, its public key, another key's public key)."""
    priv, pub = _keypair(tmp_path / "keys")
    _, other = _keypair(tmp_path / "keys", "other")
    local = make_bundle(tmp_path)
    sig = bundle.sign(local, _sign_cfg(tmp_path, "publish.sign.method=key", f"publish.sign.private_key={priv}"))
    assert sig == local / bundle.SIGNATURE and sig.stat().st_size > 100
    return local, pub, other


def _checks(where, **kw) -> dict[str, tuple[bool | None, str]]:
    return {n: (ok, m) for n, ok, m in bundle.verify(str(where), **kw)}


def test_a_signed_bundle_verifies_with_its_public_key(signed, tmp_path):
    local, pub, _ = signed
    got = _checks(local, public_key=str(pub), require_signature=True)
    assert got["signature"] == (True, f"bundle.sig verifies bundle.json with the public key {pub.name}")
    assert got["checksums"][0] is True
    proc = run_cli("verify", str(local), "--public-key", str(pub), "--require-signature", root=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS signature: bundle.sig verifies bundle.json" in proc.stdout


def _standard_tool(local: Path, pub: Path) -> subprocess.CompletedProcess:
    """OpenSSF model_signing's own command line, as ops would run it on a synced bundle."""
    return subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", str(local / "bundle.json"),
                           "--signature", str(local / bundle.SIGNATURE), "--public_key", str(pub)],
                          capture_output=True, text=True, timeout=120)


def test_the_standard_model_signing_tool_verifies_the_signature(signed):
    local, pub, other = signed
    ok = _standard_tool(local, pub)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert _standard_tool(local, other).returncode != 0  # negative control: another key
    rewrite_manifest(local / "bundle.json", lambda doc: doc.update(version="v999999999999"))
    assert _standard_tool(local, pub).returncode != 0  # negative control: an edited bundle.json


def test_a_file_tampered_and_rehashed_in_bundle_json_fails_the_signature(signed):
    local, pub, _ = signed
    victim = local / "checkpoint" / "model.safetensors"
    data = bytearray(victim.read_bytes())
    data[7] ^= 0x01
    victim.write_bytes(bytes(data))

    def rehash(doc):  # what someone with write access to publish.dest could do
        entry = next(f for f in doc["files"] if f["path"] == "checkpoint/model.safetensors")
        entry["sha256"] = hashlib.sha256(bytes(data)).hexdigest()

    rewrite_manifest(local / "bundle.json", rehash)
    got = _checks(local, public_key=str(pub))
    assert got["checksums"][0] is True  # integrity alone no longer tells
    assert got["signature"][0] is False and "bundle.sig does not verify bundle.json" in got["signature"][1]


def test_an_edited_bundle_json_fails_the_signature(signed):
    local, pub, _ = signed
    rewrite_manifest(local / "bundle.json", lambda doc: doc["gates"].update(accuracy="pass", bench="pass") or
                     doc["quant"].update(quant_algo="NVFP4"))
    got = _checks(local, public_key=str(pub))
    assert got["signature"][0] is False and "does not match the signed digest" in got["signature"][1]


def test_another_key_does_not_verify(signed):
    local, _, other = signed
    got = _checks(local, public_key=str(other))
    assert got["signature"][0] is False and "public key" in got["signature"][1]


def test_a_signed_bundle_without_a_key_to_check_it_fails(signed, tmp_path):
    local, _, _ = signed
    got = _checks(local)
    assert got["signature"][0] is False and "give --public-key PEM" in got["signature"][1]
    proc = run_cli("verify", str(local), root=tmp_path / "cwd")
    assert proc.returncode == 1 and "FAIL signature: bundle is signed (bundle.sig)" in proc.stdout


def test_require_signature_fails_an_unsigned_bundle(tmp_path):
    local = make_bundle(tmp_path)
    _, pub = _keypair(tmp_path / "keys")
    assert _checks(local)["signature"] == (None, "bundle is not signed (no bundle.sig)")
    ok = run_cli("verify", str(local), root=tmp_path / "cwd")
    assert ok.returncode == 0 and "SKIP signature: bundle is not signed" in ok.stdout
    proc = run_cli("verify", str(local), "--public-key", str(pub), "--require-signature", root=tmp_path / "cwd")
    assert proc.returncode == 1
    assert "FAIL signature: bundle is not signed (no bundle.sig) and a signature is required" in proc.stdout


def test_a_bad_private_key_is_one_line(tmp_path):
    bad = tmp_path / "bad.pem"
    bad.write_text("-----BEGIN PRIVATE KEY-----\nnot a key\n-----END PRIVATE KEY-----\n")
    local = make_bundle(tmp_path)
    with pytest.raises(UserError) as exc:
        bundle.sign(local, _sign_cfg(tmp_path, "publish.sign.method=key", f"publish.sign.private_key={bad}"))
    assert "\n" not in str(exc.value) and str(exc.value).startswith("publish.sign.method=key: signing failed (")
    assert not (local / bundle.SIGNATURE).exists()


@pytest.mark.parametrize("verb, extra, expected", [
    ("plan", ["publish.sign.method=key"], "publish.sign.method=key needs publish.sign.private_key (a PEM file)"),
    ("build", ["publish.sign.method=key", "publish.sign.private_key=/no/key.pem"],
     "publish.sign.private_key=/no/key.pem: no such file"),
    ("plan", ["publish.sign.method=certificate", "publish.sign.private_key=/k.pem"],
     "publish.sign.method=certificate needs publish.sign.signing_certificate"),
    ("plan", ["publish.sign.method=pgp"], "publish.sign.method: invalid value 'pgp'"),
])
def test_sign_settings_are_checked_before_any_work(tmp_path, verb, extra, expected):
    root = tmp_path / "out"
    proc = run_cli(verb, *TINY, *extra, root=root)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert not any(root.rglob("*.json")), "nothing written"


def test_publish_uploads_the_signature_before_bundle_json_and_restores_a_lost_one(signed, tmp_path):
    local, pub, _ = signed
    dest = tmp_path / "published"
    res = bundle.publish(local, str(dest), move_latest=True)
    doc = json.loads((local / "bundle.json").read_text())
    version = dest / ArtifactKey.of_manifest(doc).publish_prefix / doc["version"]
    assert res["uploaded_files"] == len(doc["files"]) + 2  # the files, bundle.sig, bundle.json
    assert (version / bundle.SIGNATURE).read_bytes() == (local / bundle.SIGNATURE).read_bytes()
    assert _checks(version, public_key=str(pub), require_signature=True)["signature"][0] is True
    (version / bundle.SIGNATURE).unlink()
    assert _checks(version, public_key=str(pub), require_signature=True)["signature"][0] is False
    res = bundle.publish(local, str(dest), move_latest=True)
    assert res["repaired"] == [bundle.SIGNATURE]
    assert _checks(version, public_key=str(pub), require_signature=True)["signature"][0] is True


def _ca(d: Path, name: str):
    """A self-signed CA (PEM) and its key."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    path = d / f"{name}.crt.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, cert, key


def _leaf(d: Path, ca_cert, ca_key) -> tuple[Path, Path]:
    """A signing certificate (digital signature) issued by the CA, and its private key (PEM files)."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    priv, _ = _keypair(d, "leaf")
    key = serialization.load_pem_private_key(priv.read_bytes(), password=None)
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "publisher")]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(hours=1)).not_valid_after(now + dt.timedelta(days=7))
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(ca_key, hashes.SHA256()))
    path = d / "leaf.crt.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return priv, path


def test_certificate_signing_verifies_against_its_ca_only(tmp_path):
    d = tmp_path / "pki"
    d.mkdir()
    ca_path, ca_cert, ca_key = _ca(d, "release-ca")
    other_ca, _, _ = _ca(d, "other-ca")
    priv, leaf = _leaf(d, ca_cert, ca_key)
    local = make_bundle(tmp_path)
    bundle.sign(local, _sign_cfg(tmp_path, "publish.sign.method=certificate", f"publish.sign.private_key={priv}",
                                 f"publish.sign.signing_certificate={leaf}",
                                 f"publish.sign.certificate_chain=[{ca_path}]"))
    ok = _checks(local, certificate_chain=[str(ca_path)], require_signature=True)["signature"]
    assert ok == (True, f"bundle.sig verifies bundle.json with the certificate chain {ca_path.name}")
    bad = _checks(local, certificate_chain=[str(other_ca)])["signature"]  # negative control: an untrusted CA
    assert bad[0] is False and "does not verify bundle.json with the certificate chain other-ca.crt.pem" in bad[1]


@pytest.mark.slow
def test_a_build_with_publish_sign_publishes_a_signed_bundle(tiny_build, tmp_path):
    """Only publish re-runs (its fingerprint covers publish.sign): the published version carries bundle.sig."""
    root = tmp_path / "b"
    shutil.copytree(tiny_build, root)
    priv, pub = _keypair(tmp_path / "keys")
    proc = run_cli("build", *TINY, "publish.sign.method=key", f"publish.sign.private_key={priv}", root=root,
                   env=cli_env(root))
    assert proc.returncode == 0, proc.stderr[-2000:]
    ran = {r["stage"]: r["status"] for r in report(root)["stages"]}
    why = [ln.strip() for ln in proc.stderr.splitlines() if "▶" in ln]  # each stage that ran, with its reason
    assert ran["publish"] == "ran" and ran["bench"] == "cached", (ran, why)
    (version,) = [p.parent for p in root.glob("published/*/*/*/*/v*/bundle.sig")]
    ok = run_cli("verify", str(version), "--public-key", str(pub), "--require-signature", root=tmp_path / "cwd")
    assert ok.returncode == 0 and "PASS signature" in ok.stdout, ok.stdout
    key_body = priv.read_text().split("\n")[1]
    assert key_body not in "".join(p.read_text(errors="replace") for p in version.rglob("*") if p.is_file())
