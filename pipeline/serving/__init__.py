"""An OpenAI-compatible front end for any packaged model repository, in front of Triton.

``protocol`` (request schemas, OpenAI's error body), ``model`` (what the repository says about its model:
layout, tokenizer, context length, bundle metadata), ``driver`` (generation over Triton's gRPC API through the
layout's entry points), ``app`` (the Starlette application) and ``run`` (binding and running it with uvicorn).
"""
