"""OpenAI-compatible HTTP server: aiohttp front end, one engine thread doing continuous batching.

Layout: `config` (ServerConfig), `errors` (OpenAI-style error bodies), `schemas` (request validation),
`openai_format` (response bodies and stream chunks), `scheduler` (the engine thread around the runtime's
generation loop, hybrid.runtime.batching), `adapter` (the only module that touches the model runtime's API), `metrics` (Prometheus text), `routes` + `app` (HTTP),
`testing` (a deterministic fake engine for tests). Importing this package imports nothing heavy.
"""
