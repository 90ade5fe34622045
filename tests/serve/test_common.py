"""What both services add to their app (mugrpo.serve.common): /info's progress fields, the gate between
generation and weight loads, and the errors that name the field."""
import asyncio
import time

import pytest
from pydantic import BaseModel, Field

from mugrpo.serve.common import BadRequest, ServiceState, parse_body

pytestmark = pytest.mark.unit


def test_info_says_how_long_ago_the_engine_made_progress_while_a_request_is_pending():
    state = ServiceState({"engine": "hf"}, "/w")
    assert (state.describe()["pending"], state.describe()["since_progress_s"]) == (0, None)
    state.request_taken()
    time.sleep(0.2)
    assert state.describe()["pending"] == 1 and state.describe()["since_progress_s"] >= 0.2  # nothing since it came
    state.beat()
    assert state.describe()["since_progress_s"] < 0.2  # a decode step
    state.request_done()
    assert (state.describe()["pending"], state.describe()["since_progress_s"]) == (0, None)
    state.beats = False  # vLLM: no decode steps reported, never a stall
    state.request_taken()
    assert state.describe()["since_progress_s"] is None


def test_a_load_waits_for_generations_in_flight_and_holds_new_ones():
    async def scenario():
        state, events = ServiceState({}, "/w"), []

        async def generate(name, hold_s):
            version = await state.enter()
            events.append(f"{name} starts on v{version}")
            await asyncio.sleep(hold_s)
            events.append(f"{name} ends")
            await state.leave()

        async def load():
            events.append("load")
            state.weights_version = 1

        first = asyncio.create_task(generate("a", 0.2))
        await asyncio.sleep(0.05)
        loading = asyncio.create_task(state.exclusive(load))
        await asyncio.sleep(0.05)
        second = asyncio.create_task(generate("b", 0))
        await asyncio.gather(first, loading, second)
        return events

    assert asyncio.run(scenario()) == ["a starts on v0", "a ends", "load", "b starts on v1", "b ends"]


def test_a_bad_body_names_each_field():
    class Body(BaseModel):
        n: int = Field(1, ge=1)
        path: str

    with pytest.raises(BadRequest, match=r"n: Input should be greater than or equal to 1 \(got 0\); path: Field "
                                         r"required"):
        parse_body(Body, b'{"n": 0}')
    with pytest.raises(BadRequest, match="body: Invalid JSON: recursion limit exceeded"):
        parse_body(Body, b"[" * 100_000)
    assert parse_body(Body, b'{"path": "p"}').n == 1


def test_damaged_weights_refuse_generation_until_a_whole_version_loads():
    import httpx
    from fastapi import FastAPI

    from mugrpo.serve.common import add_middleware

    state = ServiceState({}, "/w")
    app = FastAPI()
    add_middleware(app, state, {"api_key": None, "max_body_bytes": 1000, "timeout_s": 5})
    app.post("/v1/completions")(lambda: {"choices": []})
    app.get("/health")(lambda: {})
    app.get("/info")(lambda: state.describe())

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c:
            ok = (await c.post("/v1/completions", json={})).status_code
            state.damaged = "loading version 3 failed midway (OSError: disk)"
            refused = await c.post("/v1/completions", json={})
            health, info = (await c.get("/health")).status_code, (await c.get("/info")).json()
            state.damaged = None  # a whole version loaded
            return ok, refused, health, info, (await c.post("/v1/completions", json={})).status_code

    ok, refused, health, info, again = asyncio.run(scenario())
    assert ok == 200 and again == 200
    assert refused.status_code == 503 and "version 3 failed midway" in refused.json()["error"]
    assert refused.headers["x-mugrpo-boot-id"] == state.boot_id
    assert health == 503 and info["damaged"].startswith("loading version 3")


def _body_limit_events(messages, headers=(), linger_s=None):
    """What the client's channel saw, in order, when ``messages`` arrive at a BodyLimit of 1000 bytes: a
    "recv" per message taken, then the answer's status. A ``None`` message never arrives (a stalled client)."""
    from mugrpo.serve.common import BodyLimit

    events = []

    async def receive():
        message = messages.pop(0)
        if message is None:
            await asyncio.sleep(3600)
        events.append("recv")
        return message

    async def send(message):
        if message["type"] == "http.response.start":
            events.append(message["status"])

    async def app(scope, receive, send):
        raise AssertionError("a body past the limit reached the app")

    limit = BodyLimit(app, limit=1000, timeout_s=5)
    if linger_s is not None:
        limit.LINGER_S = linger_s
    asyncio.run(limit({"type": "http", "headers": list(headers)}, receive, send))
    return events


def test_a_413_reads_the_rest_of_the_body_first_so_the_close_cannot_reset_the_answer():
    chunk = {"type": "http.request", "body": b"x" * 600, "more_body": True}
    last = {"type": "http.request", "body": b"x" * 600, "more_body": False}
    # streamed: past the limit at the second chunk; the third is read (and dropped) before the answer
    assert _body_limit_events([chunk, chunk, last]) == ["recv", "recv", "recv", 413]
    # announced: refused by Content-Length, yet every chunk the client sends is read before the answer
    assert _body_limit_events([chunk, chunk, last], [(b"content-length", b"1800")]) == ["recv"] * 3 + [413]
    # a client that stops sending gets its answer when the linger ends, not never
    t0 = time.monotonic()
    assert _body_limit_events([chunk, None], [(b"content-length", b"1800")], linger_s=0.2) == ["recv", 413]
    assert time.monotonic() - t0 < 5
