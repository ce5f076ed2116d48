"""The OpenAI-compatible routes, one module per group, as vLLM's ``entrypoints/openai`` keeps them.

Each module holds an ``APIRouter`` whose routes parse a body (:mod:`kvexport.serving.protocol`),
submit to the engine and render (:mod:`kvexport.serving.api.render`); they reach the
engine through the app's :class:`~kvexport.serving.api.common.Served` (a FastAPI
dependency). :func:`kvexport.serving.app.create_app` only assembles them.

- :mod:`~kvexport.serving.api.completions`: ``POST /v1/completions``;
- :mod:`~kvexport.serving.api.chat`: ``POST /v1/chat/completions``;
- :mod:`~kvexport.serving.api.tokenize`: ``/tokenize``, ``/detokenize``, ``/tokenizer_info``;
- :mod:`~kvexport.serving.api.models`: ``/v1/models``, ``/health`` and the playground at ``/``;
- ``/metrics`` is :mod:`kvexport.serving.metrics`'s.
"""
