"""In-process tests, mirroring ``pipeline/``: no server, no model load, seconds in all (``make test-unit``)."""
