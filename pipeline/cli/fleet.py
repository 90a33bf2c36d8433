"""``matrix``, ``outdated`` and ``gc``: scheduled rebuilds of the build matrix and garbage collection."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pipeline.cli.common import add_overrides, subcommand

NAME_AND_OVERRIDES = ("the matrix name (conf/matrix/NAME.yaml, default: default), then Hydra overrides applied to "
                      "every entry")


def register(sub) -> None:
    p = subcommand(sub, "matrix", help="conf/matrix/NAME.yaml as a CI matrix (impossible entries dropped)",
                   usage="python -m pipeline matrix [-h] [--outdated] [--json] [NAME] [OVERRIDE ...]",
                   description="Print conf/matrix/NAME.yaml as a GitHub Actions matrix (`include` only) on stdout. "
                               "Entries the compatibility rules refuse are dropped, each named with its reason on "
                               "stderr.")
    p.add_argument("--outdated", action="store_true",
                   help="only the entries whose fingerprint has no published version (GPU entries this machine "
                        "cannot judge are kept, and judged on their runner by `outdated --entry`)")
    p.add_argument("--json", action="store_true", help="accepted for symmetry: the matrix is always JSON")
    add_overrides(p, metavar="ARG", help=NAME_AND_OVERRIDES)
    p.set_defaults(func=cmd_matrix)

    p = subcommand(sub, "outdated", help="matrix entries whose fingerprint has no published version yet",
                   usage="python -m pipeline outdated [-h] [--entry] [--json] [NAME] [OVERRIDE ...]",
                   description="List the matrix entries whose current fingerprint has no published version, with "
                               "what changed since the last one. With --entry, judge the one entry the overrides "
                               "compose, on this machine (a scheduled job on the entry's runner).")
    p.add_argument("--entry", action="store_true", help="judge the one entry given by the overrides")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    add_overrides(p, metavar="ARG", help=NAME_AND_OVERRIDES + " (with --entry: only the entry's overrides)")
    p.set_defaults(func=cmd_outdated)

    p = subcommand(sub, "gc", help="remove stage outputs no published bundle references (never bundles)",
                   description="Remove stage outputs that no local or published bundle references and that are "
                               "older than gc.max_age_days. Published bundles are never touched.")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    add_overrides(p)
    p.set_defaults(func=cmd_gc)


def _matrix_args(args: list[str]) -> tuple[str, list[str]]:
    name = args[0] if args and "=" not in args[0] and not args[0].startswith("-") else "default"
    return name, [a for a in args if "=" in a]


def _entry_name(e: dict[str, Any]) -> str:
    return " ".join(f"{k}={e[k]}" for k in ("model", "quant", "target", "runtime") if k in e)


def cmd_matrix(args: argparse.Namespace) -> int:
    from pipeline import fleet

    name, overrides = _matrix_args(args.args)
    keep, drop = fleet.entries(name, overrides)
    doc = fleet.ci_matrix(keep, drop)
    if args.outdated:
        here = [fleet.judged_here(e["_cfg"]) for e in keep]
        stale = {tuple(e["overrides"]) for e in fleet.outdated([e for e, ok in zip(keep, here) if ok])}
        for e in (e for e, ok in zip(keep, here) if not ok):
            stale.add(tuple(e["overrides"]))
            print(f"deferred {_entry_name(e)}: judged on its runner by `outdated --entry` (its GPU and libraries "
                  f"enter the fingerprint)", file=sys.stderr)
        doc["include"] = [e for e in doc["include"] if tuple(e["overrides"]) in stale]
    print(json.dumps(doc, separators=(",", ":")))
    return 0


def cmd_outdated(args: argparse.Namespace) -> int:
    from pipeline import fleet
    from pipeline.hardware import compose  # target/runtime auto: this machine's

    if args.entry:  # one entry given by its overrides, judged on this machine (a scheduled job on the entry's runner)
        st = fleet.entry_status(compose(args.args))
        if args.json:
            print(json.dumps(st, indent=2))
        elif st["outdated"]:
            print(f"outdated: {'; '.join(st['why'])} (would publish {st['version']})")
        else:
            print(f"up to date: {st['version']} is published")
        return 0
    name, overrides = _matrix_args(args.args)
    keep, _ = fleet.entries(name, overrides)
    stale = fleet.outdated(keep)
    if args.json:
        print(json.dumps(stale, indent=2))
    else:
        for e in stale:
            print(f"{e['model']} {e['quant']} {e['target']} {e['runtime']}: {'; '.join(e['why'])}")
        print(f"{len(stale)} of {len(keep)} entries outdated")
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    from pipeline import fleet
    from pipeline.hardware import compose  # target/runtime auto: this machine's
    from pipeline.report import human

    cfg = compose(args.args)
    dry = args.dry_run
    res = fleet.gc(cfg, float(cfg.gc.max_age_days), dry_run=dry)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        for p in res["removed"]:
            print(f"{'would remove' if dry else 'removed'} {p}")
        print(f"{len(res['removed'])} outputs {'to remove' if dry else 'removed'} ({human(res['freed_bytes'])}), "
              f"{res['kept']} kept")
    return 0
