"""``verify`` and ``diff``: check a published bundle, compare two."""
from __future__ import annotations

import argparse
import json

from pipeline.cli.common import subcommand


def register(sub) -> None:
    p = subcommand(sub, "verify", help="check a bundle: checksums, signature, GPU SM, TRT-LLM/TensorRT versions",
                   description="Verify a bundle (a directory, a bundle base with `latest`, or an fsspec URL): "
                               "checksums, signature, GPU SM, and the TensorRT-LLM/TensorRT versions (of the serving "
                               "image, from the recorded pairs). One line per check; exit 1 when any fails.")
    p.add_argument("bundle", metavar="BUNDLE_DIR_OR_URL", help="the bundle to verify")
    p.add_argument("--container", metavar="IMAGE", help="check the versions against this serving image")
    p.add_argument("--public-key", metavar="PEM", help="verify the signature with this public key")
    p.add_argument("--certificate-chain", metavar="PEM", action="append", default=[],
                   help="verify the signature with this certificate chain (repeatable)")
    p.add_argument("--require-signature", action="store_true", help="fail an unsigned bundle")
    p.add_argument("--json", action="store_true", help="print the checks as JSON on stdout")
    p.set_defaults(func=cmd_verify)

    p = subcommand(sub, "diff", help="size, accuracy, bench and version changes between two bundles (Markdown)",
                   description="Compare two bundles: size, accuracy, bench and version changes, as Markdown on "
                               "stdout.")
    p.add_argument("old", metavar="OLD_BUNDLE")
    p.add_argument("new", metavar="NEW_BUNDLE")
    p.set_defaults(func=cmd_diff)


def cmd_verify(args: argparse.Namespace) -> int:
    from pipeline import bundle

    checks = bundle.verify(args.bundle, container=args.container, public_key=args.public_key,
                           certificate_chain=args.certificate_chain, require_signature=args.require_signature)
    failed = [c for c in checks if c[1] is False]
    if args.json:
        print(json.dumps([{"check": n, "ok": ok, "message": m} for n, ok, m in checks], indent=2))
    else:
        for name, ok, msg in checks:
            print(f"{'PASS' if ok else 'SKIP' if ok is None else 'FAIL'} {name}: {msg}")
    return 1 if failed else 0


def cmd_diff(args: argparse.Namespace) -> int:
    from pipeline import bundle

    print(bundle.diff(args.old, args.new), end="")
    return 0
