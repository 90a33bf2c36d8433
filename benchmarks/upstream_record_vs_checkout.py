"""The recorded upstream interface (``pipeline/upstream``) against an upstream checkout, with the output kept.

    python benchmarks/upstream_record_vs_checkout.py --checkout TREE --repo triton-inference-server/tensorrtllm_backend \
        --commit c2e65b88d85255be30cf50440a91662abeb497dd [--line 1.2.1]

Runs ``pipeline.upstream.refresh.verify_checkout`` (what ``python -m pipeline.upstream verify --checkout`` prints)
and writes every difference, with the checkout's repository and commit and the project's own commit, to
``benchmarks/results/upstream_record_vs_<repo>-<commit>.json``. TREE is the checkout (or an ``all_models`` export of
it, e.g. ``git archive <commit> all_models | tar -x -C TREE``).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _provenance import source_state  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkout", type=Path, required=True)
    ap.add_argument("--repo", required=True, help="owner/name of the checkout")
    ap.add_argument("--commit", required=True, help="the checkout's full commit")
    ap.add_argument("--line", default="1.2.1")
    args = ap.parse_args(argv)
    from pipeline.upstream.refresh import verify_checkout

    found = verify_checkout(args.checkout, args.line)
    doc = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **source_state(),
           "checkout": {"repo": args.repo, "commit": args.commit}, "line": args.line,
           "command": f"python -m pipeline.upstream verify --checkout TREE --line {args.line}",
           "difference_count": len(found), "differences": found}
    out = REPO / "benchmarks" / "results" / f"upstream_record_vs_{args.repo.split('/')[-1]}-{args.commit[:7]}.json"
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{len(found)} difference(s); {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
