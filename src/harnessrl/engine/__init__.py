"""engine: the builtin inference engine (continuous batching over a KV cache, exact ids and logprobs).

Modules, outside in: `server` (build_app, ServerThread, `python -m harnessrl.engine`), `routes` (HTTP
handlers), `protocol` (wire shapes, response builders), `core` (Engine: model + tokenizer + scheduler),
`scheduler` (the batching thread), `state` (EngineState: awake / asleep / waiting for weights, and the
transition table that sleep, wake-up and weight loads follow; pause is a separate flag), `slots` (KV-slot
bookkeeping and prefix cache), `sampling`, `detok`.
This package itself imports nothing heavy, so the torch-free core can list it.
"""
