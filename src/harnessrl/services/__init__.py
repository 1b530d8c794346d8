"""Starting and stopping the processes a run serves from: the builtin engine, the gateway (replicas),
a managed vLLM server, and the stack of them that one run or check uses.

- `process`: a child process (dies with its parent), a `Service` with its log, free ports;
- `builtin`: the engine and gateway command lines;
- `vllm`: a vLLM server from vLLM's own venv, and the untied model view it serves;
- `stack`: the engine + gateways of one run, started together, stopped with one `stop()`.
"""

from __future__ import annotations

from harnessrl.services.builtin import start_engine, start_gateway
from harnessrl.services.process import Service, die_with_parent, free_port, start_service

__all__ = ["Service", "die_with_parent", "free_port", "start_engine", "start_gateway", "start_service"]
