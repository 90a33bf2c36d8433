"""An OpenAI-compatible front end for any packaged model repository, in front of Triton.

``protocol`` (the request and response models, OpenAI's error body), ``frontend`` (``FrontEnd.from_config``: the
front end a ``serve.openai`` config describes, its settings and request checks), ``chat`` and ``completions`` (the
two generation endpoints, on ``endpoint``'s shared base), ``app`` (the Starlette routes), ``model`` (what the
repository says about its model: layout, tokenizer, context length, bundle metadata), ``codec`` (what a layout's
codec is made of: the generation request, a response's delta, the codec base each layout folder builds on),
``driver`` (generation over Triton's gRPC API through the layout's codec), ``transport`` (the shared gRPC streams,
their inboxes and watchdog; the server-sent-event response), ``observe`` (request ids, ``/metrics``, the access
log), ``drain`` (the graceful stop) and ``run`` (binding and running it with uvicorn, in this process or a child).
``alert_rules.yml``: Prometheus rules over ``/metrics``.
"""
