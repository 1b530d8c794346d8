"""The real SmolLM2-135M-Instruct through the engine: exact logprobs, EOS kept in the ids (slow: -m slow)."""

from __future__ import annotations

import httpx
import pytest
import torch

from harnessrl.engine.config import EngineConfig
from harnessrl.engine.server import Engine, ServerThread
from harnessrl.modeling.loading import load_model
from tests.conftest_engine import full_forward_logprobs


@pytest.mark.slow
def test_smollm2_chat_is_exact_and_ends_with_eos() -> None:
    engine = Engine(EngineConfig(model="smollm2", max_batch=2, max_model_len=512))
    server = ServerThread(engine).start()
    try:
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 40,
            "temperature": 0.7,
            "seed": 0,
            "logprobs": True,
        }
        res = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300).json()
    finally:
        server.stop()
    choice = res["choices"][0]
    assert "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and choice["token_ids"][-1] == 2  # <|im_end|> sampled, kept
    reported = torch.tensor([c["logprob"] for c in choice["logprobs"]["content"]])
    recomputed = full_forward_logprobs(
        load_model("smollm2"), res["prompt_token_ids"], choice["token_ids"], 0.7
    )
    assert (reported - recomputed).abs().max().item() < 1e-4
