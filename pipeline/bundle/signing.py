"""Signing a bundle's ``bundle.json`` with OpenSSF model_signing (``bundle.sig`` beside it) and checking that
signature: the plan-time problems of ``publish.sign``, :func:`sign`, :func:`signature_check`."""
from __future__ import annotations

import os
from pathlib import Path

from pipeline.bundle.manifest import SIGNATURE
from pipeline.errors import UserError


def sign_problems(sign, *, environment: bool = True) -> list[str]:
    """Plan-time problems of ``publish.sign``: settings a method needs; with ``environment``, also what this machine
    must have (the key files, the password variable, the library)."""
    method = sign.method.value if hasattr(sign.method, "value") else str(sign.method)
    if method == "none":
        return []
    problems = []
    need = {"key": ("private_key",), "certificate": ("private_key", "signing_certificate")}.get(method, ())
    for key in need:
        if not sign.get(key):
            problems.append(f"publish.sign.method={method} needs publish.sign.{key} (a PEM file)")
    if not environment or problems:
        return problems
    try:
        import model_signing  # noqa: F401
    except ImportError:
        problems.append(f"publish.sign.method={method} needs OpenSSF model-signing: pip install -e '.[sign]'")
    for key in need:
        if not Path(str(sign.get(key))).expanduser().is_file():
            problems.append(f"publish.sign.{key}={sign.get(key)}: no such file")
    if method == "certificate":
        for c in sign.certificate_chain or []:
            if not Path(str(c)).expanduser().is_file():
                problems.append(f"publish.sign.certificate_chain: {c}: no such file")
    if sign.get("password_env") and sign.password_env not in os.environ:
        problems.append(f"publish.sign.password_env={sign.password_env}: that environment variable is not set")
    return problems


def sign(bundle_dir: Path, sign_cfg) -> Path | None:
    """Sign ``bundle_dir/bundle.json`` with OpenSSF model_signing (a Sigstore bundle over the file's sha256), writing
    ``bundle.sig`` beside it; None when ``publish.sign.method=none``. bundle.json names every file with its sha256,
    so the signature covers the whole bundle once ``verify`` has checked the files against it."""
    method = sign_cfg.method.value if hasattr(sign_cfg.method, "value") else str(sign_cfg.method)
    if method == "none":
        return None
    problems = sign_problems(sign_cfg)
    if problems:
        raise UserError(problems[0])
    from model_signing import hashing, signing

    expand = lambda v: Path(str(v)).expanduser()  # noqa: E731
    config = signing.Config().set_hashing_config(hashing.Config().use_file_serialization(hashing_algorithm="sha256"))
    password = os.environ.get(sign_cfg.password_env) if sign_cfg.get("password_env") else None
    out = bundle_dir / SIGNATURE
    try:
        if method == "key":
            config.use_elliptic_key_signer(private_key=expand(sign_cfg.private_key), password=password)
        elif method == "certificate":
            config.use_certificate_signer(private_key=expand(sign_cfg.private_key),
                                          signing_certificate=expand(sign_cfg.signing_certificate),
                                          certificate_chain=[expand(c) for c in sign_cfg.certificate_chain or []])
        else:
            config.use_sigstore_signer(use_ambient_credentials=True)
        config.sign(bundle_dir / "bundle.json", out)
    except Exception as exc:  # model_signing and cryptography raise many types for a bad key, password or network
        out.unlink(missing_ok=True)
        raise UserError(f"publish.sign.method={method}: signing failed ({type(exc).__name__}: "
                        f"{(str(exc).splitlines() or [''])[0]}); check the key, its password and certificates") from exc
    return out


def signature_check(fs, root: str, raw_manifest: bytes, *, public_key: str | None = None,
                    certificate_chain: list[str] | None = None,
                    require: bool = False) -> tuple[str, bool | None, str]:
    """The ``signature`` check: ``bundle.sig`` verified over the bundle.json that the checksums were checked against,
    with a public key (method key) or a certificate chain (method certificate)."""
    import tempfile

    try:
        sig = fs.cat_file(f"{root}/{SIGNATURE}")
    except FileNotFoundError:
        if require:
            return ("signature", False, f"bundle is not signed (no {SIGNATURE}) and a signature is required")
        return ("signature", None, f"bundle is not signed (no {SIGNATURE})")
    if not public_key and not certificate_chain:
        return ("signature", False, f"bundle is signed ({SIGNATURE}): give --public-key PEM or --certificate-chain PEM "
                                    f"to check who signed it")
    try:
        from model_signing import verifying
    except ImportError:
        return ("signature", False, "checking bundle.sig needs OpenSSF model-signing: pip install -e '.[sign]'")
    for path in [public_key, *(certificate_chain or [])]:
        if path and not Path(path).expanduser().is_file():
            raise UserError(f"{path}: no such file (a PEM public key or certificate)")
    with tempfile.TemporaryDirectory(prefix="verify-") as tmp:
        (Path(tmp) / "bundle.json").write_bytes(raw_manifest)
        (Path(tmp) / SIGNATURE).write_bytes(sig)
        config = verifying.Config()
        if public_key:
            config.use_elliptic_key_verifier(public_key=Path(public_key).expanduser())
            how = f"public key {Path(public_key).name}"
        else:
            config.use_certificate_verifier(certificate_chain=[Path(c).expanduser() for c in certificate_chain])
            how = "certificate chain " + ", ".join(Path(c).name for c in certificate_chain)
        try:
            config.verify(Path(tmp) / "bundle.json", Path(tmp) / SIGNATURE)
        except Exception as exc:  # model_signing raises ValueError and sigstore/cryptography errors
            why = (str(exc).splitlines() or [type(exc).__name__])[0][:300]
            if "Signature mismatch" in why or "Hash mismatch" in why:
                why = "bundle.json does not match the signed digest (edited after signing)"
            return ("signature", False, f"{SIGNATURE} does not verify bundle.json with the {how}: {why}")
    return ("signature", True, f"{SIGNATURE} verifies bundle.json with the {how}")
