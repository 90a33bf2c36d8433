"""The recorded upstream interface (``pipeline/upstream``) against an upstream checkout, with the output kept.

    python -m benchmarks upstream_record_vs_checkout --checkout TREE \
        --repo triton-inference-server/tensorrtllm_backend --commit c2e65b88d85255be30cf50440a91662abeb497dd \
        [--line 1.2.1]

Runs ``pipeline.upstream.refresh.verify_checkout`` (what ``python -m pipeline.upstream verify --checkout`` prints)
and records every difference with the checkout's repository and commit. TREE is the checkout (or an ``all_models``
export of it, e.g. ``git archive <commit> all_models | tar -x -C TREE``). The page keeps one current record per
upstream repository.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks._provenance import commit_label

TITLE = "The recorded upstream interface against an upstream checkout"
RESULT_NAMES = ("upstream_record_vs_checkout", "upstream_record_vs_tensorrtllm_backend")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkout", type=Path, required=True)
    parser.add_argument("--repo", required=True, help="owner/name of the checkout")
    parser.add_argument("--commit", required=True, help="the checkout's full commit")
    parser.add_argument("--line", default="1.2.1")


def run(args) -> dict:
    from pipeline.upstream.refresh import verify_checkout

    found = verify_checkout(args.checkout, args.line)
    print(f"{len(found)} difference(s)")
    return {"checkout": {"repo": args.repo, "commit": args.commit}, "line": args.line,
            "command": f"python -m pipeline.upstream verify --checkout TREE --line {args.line}",
            "difference_count": len(found), "differences": found}


def suffix(record: dict) -> str:
    return f"{record['checkout']['repo'].split('/')[-1]}-{record['checkout']['commit'][:7]}"


def variant(record: dict) -> str:
    return record["checkout"]["repo"]


def render(record: dict) -> list[str]:
    co = record["checkout"]
    by_component: dict[str, list[str]] = {}
    for d in record["differences"]:  # "layout/model: what differs", one line per component on the page
        component, _, what = d.partition(": ")
        by_component.setdefault(component, []).append(what)
    return [f"{record['date'][:10]} · commit {commit_label(record)} · the record for TensorRT-LLM line "
            f"{record['line']} against {co['repo']} @ {co['commit'][:9]} (`{record['command']}`): "
            f"{record['difference_count']} difference(s).", "",
            *(f"- {c} ({len(w)}): {'; '.join(w)}" for c, w in by_component.items())]
