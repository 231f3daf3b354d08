"""Plays a user script (users.py) against an OpenAI-compatible server and records every request.

Each user is one asyncio task: it waits for its arrival time, sends its first message (the document and the
question), streams the answer, waits `think_s`, sends the next turn with the conversation so far, and so on: as chat
messages (/v1/chat/completions), or for a model without a chat template as one growing prompt (/v1/completions,
users.follow_up_prompt). A turn
that fails (the server refuses the prompt, the connection drops, the timeout passes) ends the user's conversation:
it is recorded with its error and the conversation counts as not completed.

Times are taken with time.monotonic on the client, as a user of the API sees them:
- ttft_s: from sending the request to the first streamed chunk that carries text;
- e2e_s: from sending to the end of the stream;
- decode_tok_s: (completion tokens - 1) / (e2e_s - ttft_s), the speed after the first token.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass

from .users import User, follow_up_prompt


@dataclass
class Request:
    user: int
    turn: int                  # 0: the first question
    source: str
    start_s: float             # seconds after the run's start
    ttft_s: float | None
    e2e_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    decode_tok_s: float | None
    answer: str
    score: float | None        # None when the request failed
    error: str | None

    def as_dict(self) -> dict:
        return asdict(self)


async def _one(client, model: str, conversation: list[dict] | str, max_tokens: int, t_run: float, user: User,
               turn: int) -> Request:
    import openai

    t0 = time.monotonic()
    ttft = None
    parts: list[str] = []
    usage = None
    chunks = 0
    try:
        common = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True,
                      stream_options={"include_usage": True})
        if user.completion:
            stream = await client.completions.create(prompt=conversation, **common)
        else:
            stream = await client.chat.completions.create(messages=conversation, **common)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices or ():
                if user.completion:
                    text = choice.text
                else:
                    text = choice.delta.content if choice.delta is not None else None
                if text:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    parts.append(text)
                    chunks += 1
    except (openai.APIError, OSError, asyncio.TimeoutError) as e:
        status = getattr(e, "status_code", None)
        why = f"HTTP {status}: " if status else ""
        message = getattr(e, "message", None) or str(e) or type(e).__name__
        return Request(user.id, turn, user.source, round(t0 - t_run, 4), None, None, None, None, None, "", None,
                       (why + message)[:300])
    e2e = time.monotonic() - t0
    answer = "".join(parts)
    n_out = usage.completion_tokens if usage is not None else chunks
    n_in = usage.prompt_tokens if usage is not None else None
    if ttft is None:
        ttft = e2e     # nothing but an empty answer came: its first (and only) event is the end
    decode = (n_out - 1) / (e2e - ttft) if n_out and n_out > 1 and e2e > ttft else None
    return Request(user.id, turn, user.source, round(t0 - t_run, 4), round(ttft, 4), round(e2e, 4), n_in, n_out,
                   round(decode, 3) if decode is not None else None, answer, user.score(answer), None)


async def _conversation(client, model: str, user: User, max_tokens: int, think_s: float, t_run: float,
                        record) -> None:
    await asyncio.sleep(max(0.0, t_run + user.arrival_s - time.monotonic()))
    # chat messages, or for a model without a chat template one prompt that grows turn by turn
    conversation: list[dict] | str = user.document if user.completion else [{"role": "user", "content": user.document}]
    answer = ""
    for turn, text in enumerate((None,) + user.turns):
        if text is not None:
            await asyncio.sleep(think_s)
            if user.completion:
                conversation = follow_up_prompt(conversation, answer, text)
            else:
                conversation = conversation + [{"role": "assistant", "content": answer},
                                               {"role": "user", "content": text}]
        r = await _one(client, model, conversation, max_tokens, t_run, user, turn)
        record(r)
        if r.error is not None:
            return
        answer = r.answer


async def play(url: str, users: list[User], *, max_tokens: int = 48, think_s: float = 1.0, timeout_s: float = 3600,
               model: str = "locret", on_request=None) -> tuple[list[Request], float]:
    """Every user's conversation against the server at `url` (http://host:port); the requests in the order they
    ended and the run's wall time in seconds (from the start to the last answer). `on_request(r)` is called as
    each one ends (a progress bar, a journal)."""
    import openai

    records: list[Request] = []

    def record(r: Request) -> None:
        records.append(r)
        if on_request is not None:
            on_request(r)

    # the client's own HTTP pool (up to 1,000 connections: a connection per user at once); no HTTP library of ours,
    # the one the openai package brings is its own business
    async with openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0,
                                  timeout=timeout_s) as client:
        t_run = time.monotonic()
        await asyncio.gather(*(_conversation(client, model, u, max_tokens, think_s, t_run, record) for u in users))
        wall = time.monotonic() - t_run
    return records, wall


def run(url: str, users: list[User], **kwargs) -> tuple[list[Request], float]:
    """play() from synchronous code."""
    return asyncio.run(play(url, users, **kwargs))
