"""Server-sent events as OpenAI sends them: `data: <json>\n\n` per chunk, an error event if the
stream fails, and always `data: [DONE]` last."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pydantic import BaseModel

from services.gateway.errors import error_of

DONE = "data: [DONE]\n\n"


def event(chunk: BaseModel) -> str:
    return f"data: {chunk.model_dump_json()}\n\n"


async def sse_stream(chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """The SSE body for `chunks`; an error raised by them becomes an error event before [DONE]."""
    try:
        async for chunk in chunks:
            yield event(chunk)
    except Exception as e:  # the client gets the error in the stream; the status line is already sent
        _, body = error_of(e)
        yield f"data: {body.model_dump_json()}\n\n"
    yield DONE
