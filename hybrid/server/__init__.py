"""OpenAI-compatible HTTP server: aiohttp front end, one engine thread doing continuous batching.

Layout: `config` (ServerConfig), `errors` (OpenAI-style error bodies), `schemas` (request validation),
`detok` (incremental detokenization + stop strings), `scheduler` (the engine thread), `adapter` (the only
module that touches the model runtime's API), `metrics` (Prometheus text), `routes` + `app` (HTTP).
Importing this package imports nothing heavy; torch and aiohttp load with the modules that need them.
"""
