"""``lint REPO``: check a Triton model repository against upstream's recorded interface."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeline.cli.common import subcommand


def register(sub) -> None:
    p = subcommand(sub, "lint", help="check a Triton model repository against upstream's recorded interface",
                   description="Check a Triton model repository (generated or hand-edited) against upstream's "
                               "recorded interface for a TensorRT-LLM version: one line per finding on stderr, exit "
                               "2 when there is any, `ok: REPO` otherwise.")
    p.add_argument("repo", metavar="REPO", help="the model repository (the directory holding */config.pbtxt)")
    p.add_argument("--trtllm-version", metavar="X", help="check against this TensorRT-LLM version's record")
    p.add_argument("--container", metavar="IMAGE",
                   help="check against the TensorRT-LLM version installed in this serving image")
    p.add_argument("--repo-mount", metavar="PATH",
                   help="where the serving container mounts the repository (default /models)")
    p.add_argument("--no-engine", action="store_true",
                   help="a repository rendered before its build (python -m pipeline render): the engine directory "
                        "(tensorrt_llm/1/engine) is not looked for")
    p.set_defaults(func=cmd_lint)


def cmd_lint(args: argparse.Namespace) -> int:
    """Print every finding, one per line; exit 2 when there is any (a repository that would fail to serve)."""
    from pipeline.triton import lint

    findings = lint.lint(Path(args.repo), trtllm_version=args.trtllm_version,
                         repo_mount=args.repo_mount or lint.REPO_MOUNT, container=args.container,
                         engine=not args.no_engine)
    for f in findings:
        print(f"error: {f}", file=sys.stderr)
    if not findings:
        print(f"ok: {args.repo}")
    return 2 if findings else 0
