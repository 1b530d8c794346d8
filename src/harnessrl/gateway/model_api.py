"""The model API's routes (rollout keys): the chat faces (OpenAI chat, Anthropic messages, Responses),
completions, token counting, the model listing and a harness's own reward where its task allows it.
Each route is also served under `/r/{rollout_id}/` for harnesses that can only change the base URL."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from harnessrl.gateway.call_annotations import annotate as annotate_call
from harnessrl.gateway.calls import ModelCalls
from harnessrl.gateway.errors import APIError, validate
from harnessrl.gateway.faces import Face
from harnessrl.gateway.faces.anthropic import AnthropicFace, MessagesRequest
from harnessrl.gateway.faces.completions import CompletionRequest
from harnessrl.gateway.faces.models import model_card, model_list, wants_anthropic
from harnessrl.gateway.faces.openai_chat import ChatCompletionRequest, OpenAIChatFace
from harnessrl.gateway.faces.responses import ResponsesFace, ResponsesRequest
from harnessrl.gateway.http import Handler, RouteSpec, read_json
from harnessrl.gateway.state import Gateway
from harnessrl.schema import AnnotationIn, RewardIn

ROLLOUT_PREFIX = "/r/{rollout_id}"
POLICY_PREFIX = (
    "/p/{policy}"  # several policies: the route chooses the policy (harnesses that send one model name)
)


class ModelAPIRoutes:
    """Handlers of the model API over the gateway's state; `table()` lists them with their OpenAPI
    entries, each once at `/v1/...` and once under `/r/{rollout_id}/`."""

    def __init__(self, gw: Callable[[], Gateway]) -> None:
        self._gw = gw
        self._calls: ModelCalls | None = None

    @property
    def calls(self) -> ModelCalls:
        """The model-call handlers over the running gateway's state."""
        gw = self._gw()
        if self._calls is None or self._calls.gw is not gw:
            self._calls = ModelCalls(gw)
        return self._calls

    def face(self, face: Face) -> Handler:
        """The handler of one chat face."""

        async def handle(request: Request) -> Response:
            return await self.calls.chat(request, face)

        return handle

    async def completion(self, request: Request) -> Response:
        return await self.calls.completion(request)

    async def count_tokens(self, request: Request) -> Response:
        return await self.calls.count_tokens(request)

    async def models(self, request: Request) -> Response:
        g = self._gw()
        g.rollout_for(request, request.path_params.get("rollout_id"))
        route_policy = request.path_params.get("policy")
        names = sorted({g.config.served_model, *g.config.model_map, *g.policy_model_names()})
        served = {n: g.route(n, route_policy)[0] for n in names}  # with policies: the policy's adapter
        return JSONResponse(model_list(names, wants_anthropic(request.headers), served))

    async def model(self, request: Request) -> Response:  # any name a client sends is served
        g = self._gw()
        g.rollout_for(request, request.path_params.get("rollout_id"))
        name = request.path_params["model_id"]
        served = g.route(name, request.path_params.get("policy"))[0]
        return JSONResponse(model_card(name, wants_anthropic(request.headers), served))

    async def self_reward(self, request: Request) -> Response:
        g = self._gw()
        rollout = g.rollout_for(request, request.path_params.get("rollout_id"))
        if rollout.metadata.get("allow_self_reward") is not True:
            raise APIError(403, "this rollout's task does not let the harness write its reward")
        value = validate(RewardIn, await read_json(request, g.config.max_body_bytes))
        stored = g.store.set_reward(rollout.rollout_id, value)
        return JSONResponse(stored.model_dump(mode="json"))

    async def annotate(self, request: Request) -> Response:
        return await annotate_call(self._gw(), request)

    def table(self) -> list[RouteSpec]:
        """Every model-API route with its OpenAPI entry, at `/v1/...`, under `/r/{rollout_id}/`, and the
        model calls under `/p/{policy}/` (several policies)."""
        base = [
            RouteSpec("/v1/chat/completions", "POST", self.face(OpenAIChatFace()), "OpenAI chat completions",
                      ChatCompletionRequest, counted=True),
            RouteSpec("/v1/messages", "POST", self.face(AnthropicFace()), "Anthropic messages", MessagesRequest,
                      error_style="anthropic", counted=True),
            RouteSpec("/v1/responses", "POST", self.face(ResponsesFace()), "OpenAI Responses", ResponsesRequest,
                      counted=True),
            RouteSpec("/v1/completions", "POST", self.completion, "OpenAI completions", CompletionRequest,
                      counted=True),
            RouteSpec("/v1/messages/count_tokens", "POST", self.count_tokens,
                      "Anthropic: tokens a messages request would take", MessagesRequest,
                      error_style="anthropic", counted=True),
            RouteSpec("/v1/models", "GET", self.models, "served models"),
            RouteSpec("/v1/models/{model_id:path}", "GET", self.model,
                      "one model (any name resolves to the served model)"),
            RouteSpec("/v1/harnessrl/reward", "PUT", self.self_reward,
                      "the harness writes its rollout's reward (only if its task allows)", RewardIn),
            RouteSpec("/v1/harnessrl/annotations", "POST", self.annotate,
                      "the harness annotates one of its calls (data; a step reward only where its task allows)",
                      AnnotationIn),
        ]  # fmt: skip
        prefixed = [
            dataclasses.replace(s, path=ROLLOUT_PREFIX + s.path, summary=f"{s.summary} (rollout in the path)")
            for s in base
        ]
        by_policy = [
            dataclasses.replace(s, path=POLICY_PREFIX + s.path, summary=f"{s.summary} (policy in the path)")
            for s in base
            if s.path.startswith(
                ("/v1/chat", "/v1/messages", "/v1/responses", "/v1/completions", "/v1/models")
            )
        ]
        return base + prefixed + by_policy
