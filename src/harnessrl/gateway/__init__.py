"""gateway: the model endpoint a harness is pointed at, and the control API the controller and trainer use.

Modules, outside in:
- `app` (GatewayConfig, Gateway: the shared state, `create_app`), `__main__` (`python -m harnessrl.gateway`),
  `http` (the door: JSON policy, body/header limits, guards), `errors` (OpenAI/Anthropic error shapes, error log);
- the model API: `calls` (the handlers: chat faces, raw completions, token counting), `faces/` (OpenAI chat,
  Anthropic messages, Responses, completions: each API's request → `ChatCall`, `Generation` → answer/stream),
  `canonical` (the one internal form of a call), `budget` (max_tokens against the context), `history` (recent
  calls of a rollout), `tito` (token-in-token-out prompts);
- admission and recording: `access` (admin and rollout keys, the bounded rollout cache), `keys` (per-rollout
  keys), `admission` (in flight, pause/preemption, clients that hang up), `recording` (call records and their
  metrics), `writer` (group commit to the store), `metrics` (Prometheus text);
- `engine_client/`: `inference` (passthrough/tito requests), `answers` (pure reading of engine answers),
  `upstream` (replicas, retries), `httpclient` (keep-alive HTTP/1.1), `sglang` (SGLang's /generate);
- the control API: `control` (routes), `client` (ControlClient, used by the controller and trainer), `openapi`.
"""
