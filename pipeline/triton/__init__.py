"""Triton: layout folders (``layouts/``), rendering, ``lint``, the server launcher and the streaming gRPC client."""
