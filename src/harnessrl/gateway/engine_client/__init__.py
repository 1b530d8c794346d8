"""engine_client: how the gateway reaches the engines behind it.

`inference` (a canonical call as a passthrough or tito request, streamed or whole, into a `Generation`),
`answers` (pure reading of the engine's answers and stream events into token records; the one place a
malformed answer becomes `BadUpstreamResponse`), `upstream` (replicas, sticky per rollout, retries and
failover), `httpclient` (the keep-alive HTTP/1.1 client of the hot path), `sglang` (SGLang's native
/generate behind the engine protocol).
"""
