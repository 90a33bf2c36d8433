"""The project's benchmarks, run as one instrument: ``python -m benchmarks NAME [run|render] [options]``.

A benchmark is a module ``benchmarks/NAME.py`` (names starting with ``_`` are helpers) with:

- a module docstring: what it measures and how to run it (``python -m benchmarks NAME --help`` prints it);
- ``add_arguments(parser: argparse.ArgumentParser) -> None``: its own options;
- ``run(args) -> dict``: measures, and returns the raw record's own fields (``None``: a step that records nothing; a
  field ``error`` marks a failed run: recorded, exit 1, never the page's current block);
- ``render(record: dict) -> list[str]``: the markdown lines of the current block for one record (no heading: the
  page gives each section its own). A record of an older form that ``render`` cannot read (a ``KeyError``, ...) is
  listed among the older runs.

The shared options (``--no-record``, ``--out DIR``, ``--suffix``, ``--note``) come first; a benchmark's own option of
the same name replaces the shared one.

Optional: ``TITLE`` (the section heading; default: the docstring's first sentence), ``RESULT_NAMES`` (the file-name
stems its records carry, default ``(NAME,)``), ``variant(record) -> str`` (a benchmark that keeps several current
figures, e.g. one per machine, names the variant a record belongs to) and ``suffix(record) -> str`` (added to the
record's file name).

The instrument (:mod:`benchmarks._instrument`) parses the shared options, adds the provenance (``benchmark``,
``date``, ``commit``, ``dirty``, ``machine``, ``source_sha256``), writes the raw record on one line to
``benchmarks/results/NAME-<YYYY-MM-DD>-<commit>[-suffix].json`` and regenerates ``docs/benchmarks.md`` from every
record there.

A record may carry ``analysis``: markdown that explains its figures (written into the raw JSON after the run, by
whoever read them); the page shows it under the record's block while the record is current. ``--note`` keeps a note
of why a run was made in the record (not shown).
"""
