"""What a non-interactive run may print: no redrawn progress frames, no library deprecation chatter."""
from __future__ import annotations

import re

# Lines that are library noise in a CI log: Python warnings (``path:line: FutureWarning: ...``), deprecation notices
# (transformers' "`torch_dtype` is deprecated! Use `dtype` instead!"), and tqdm bars ("42%|████▏ | 5/12 [00:01<...]").
NOISE = [
    (re.compile(r"deprecat", re.I), "a deprecation notice"),
    (re.compile(r"\b\w*Warning: "), "a Python warning"),
    (re.compile(r"\d+%\|.*\|\s*\d+/\d+"), "a tqdm progress bar"),
    (re.compile(r"\b\d+(\.\d+)?(it|s)/(s|it)\]"), "a tqdm rate"),
]


def console_problems(text: str) -> list[str]:
    """Every problem of a captured stdout/stderr: carriage-return frames (a bar redrawn in place) and noise lines."""
    problems = []
    frames = text.count("\r") - text.count("\r\n")
    if frames:
        problems.append(f"{frames} carriage-return progress frames")
    for line in re.split(r"\r\n|\r|\n", text):
        for pattern, what in NOISE:
            if pattern.search(line):
                problems.append(f"{what}: {line.strip()[:200]}")
                break
    return problems
