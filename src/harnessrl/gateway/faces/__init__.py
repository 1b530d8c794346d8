"""API faces of the gateway: each translates its wire format to and from the canonical chat call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from harnessrl.gateway.canonical import ChatCall, Generation

if TYPE_CHECKING:
    from harnessrl.gateway.history import History


class Face(Protocol):
    """One model API (OpenAI chat, Responses, Anthropic messages) over the canonical call."""

    name: str
    error_style: str  # "openai" or "anthropic": the shape of error bodies on this face

    def parse(self, body: Any) -> Any:
        """Validate the body; raise `APIError(400)` naming the field."""

    def to_chat_call(self, req: Any, history: History) -> ChatCall:
        """The canonical call (`history`: this attempt's earlier calls, read only by stateful APIs)."""

    def render(self, gen: Generation, req: Any, ids: ResponseIds) -> dict[str, Any]:
        """The face's answer object."""

    def streamer(self, req: Any, ids: ResponseIds) -> Streamer | None:
        """The event writer for `stream: true`, or None when the request did not ask to stream."""

    def describe(self, req: Any) -> dict[str, Any]:
        """What the call record says about the request beyond its conversation: `ignored_fields`
        (fields not used for generation), `dropped_tools` (tools the model cannot be offered), ..."""


class Streamer(Protocol):
    """Writes one streamed answer in a face's event format."""

    def start(self) -> list[str]:
        """Frames before any content."""

    def delta(self, text: str) -> list[str]:
        """Frames carrying a piece of content."""

    def reasoning(self, text: str) -> list[str]:
        """Frames carrying a piece of a reasoning model's thinking (all of it comes before the content)."""

    def end(self, gen: Generation, out: dict[str, Any]) -> list[str]:
        """Frames after the content: tool calls, stop reason, usage (`out`: the face's answer object)."""

    def error(self, message: str) -> list[str]:
        """Frames that end the stream with an error."""


@dataclass(frozen=True)
class ResponseIds:
    """Ids and timestamp minted for one answer."""

    response_id: str
    created: int
