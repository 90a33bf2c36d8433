"""Bundles for ops, one module per job: ``manifest`` (the ``bundle.json`` schema and the bundle's tree), ``signing``
(``bundle.sig``), ``remote`` (publishing to any fsspec destination, its versions and ``latest``), ``verifying``
(``verify``) and ``diffing`` (``diff``). The names other modules use are re-exported here."""
from __future__ import annotations

from pipeline.bundle.diffing import diff, flatten, recipe_settings, serving_rows
from pipeline.bundle.manifest import (KEEP, SCHEMA, SIGNATURE, BundleManifest, FileEntry, ModelInfo, Provenance,
                                      QuantInfo, RuntimeVersions, bundle_tree, is_litter, schema_json, store_dirs)
from pipeline.bundle.remote import (OBJECT_STORES, STALE_UPLOAD_S, complete_versions, current_version, filesystem,
                                    open_manifest, publish, published_base, read_published, redact, store_error,
                                    store_errors)
from pipeline.bundle.signing import sign, sign_problems, signature_check
from pipeline.bundle.verifying import container_check, loadability_check, tree_check, verify

__all__ = [
    "KEEP", "OBJECT_STORES", "SCHEMA", "SIGNATURE", "STALE_UPLOAD_S", "BundleManifest", "FileEntry", "ModelInfo",
    "Provenance", "QuantInfo", "RuntimeVersions", "bundle_tree", "complete_versions", "container_check",
    "current_version", "diff", "filesystem", "flatten", "is_litter", "loadability_check", "open_manifest", "publish",
    "published_base", "read_published", "recipe_settings", "redact", "schema_json", "serving_rows", "sign",
    "sign_problems",
    "signature_check", "store_dirs", "store_error", "store_errors", "tree_check", "verify",
]
