"""``offline-plugins serve reward DIR`` and ``serve judge SPEC``: a reward model or a judge over HTTP.

An aiohttp server (:func:`make_app`) with three routes, each of which needs ``Authorization:
Bearer TOKEN`` (401 otherwise; the token is compared in constant time):

- ``POST /v1/score`` ``{"prompts": [...], "responses": [...]}`` -> ``{"scores": [...]}`` (a reward server);
- ``POST /v1/judge`` ``{"prompts", "firsts", "seconds"}`` -> ``{"p_first": [...]}`` (a judge server:
  P(the first shown is better));
- ``GET /v1/health`` -> what it serves.

A request is scored as one batch, at most ``max_batch`` items (413 beyond) and ``max_bytes`` bytes
(413), within ``timeout`` seconds (504); requests are scored one at a time (the model is not shared
between threads). A body that is not the shape above is a 400 naming what is wrong; a model that
answers a non-finite score is a 500 (the client refuses it too). The server binds 127.0.0.1 unless
told otherwise. The training side is :mod:`offline_plugins.text.sources.remote`.
"""

from __future__ import annotations

import asyncio
import hmac
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from offline_plugins.errors import UserError
from offline_plugins.eval.judge import judge_from
from offline_plugins.text.sources.prompts import load_reward_function
from offline_plugins.text.sources.remote import is_url

__all__ = ["make_app", "serve", "reward_scorer", "judge_scorer", "ROUTES"]

ROUTES = {"reward": ("/v1/score", ("prompts", "responses"), "scores"),
          "judge": ("/v1/judge", ("prompts", "firsts", "seconds"), "p_first")}


def reward_scorer(folder: str) -> Callable[..., Sequence[float]]:
    """The scores of a ``train reward-model`` (or ``prm``) output, as ``--reward DIR`` gives them in process
    (a registered reward's name or ``MODULE:FUNCTION`` serves too); a path that is not there, or another
    server's address, is refused naming what ``serve reward`` takes."""
    text = str(folder)
    takes = "give the OUT folder of 'offline-plugins train reward-model' (or 'train prm'), or its OUT/reward_model"
    if is_url(text):
        raise UserError(f"serve reward {text!r} is a server's address; serve reward loads a model on this "
                        f"machine: {takes}")
    if ("/" in text or text.startswith((".", "~"))) and not Path(text).expanduser().exists():
        raise UserError(f"serve reward {text!r}: no such folder; {takes}")
    return load_reward_function(text)


def judge_scorer(spec: str) -> Callable[..., Sequence[float]]:
    """P(first is better) of the judge ``spec`` names (``--judge`` in process: a registered judge, a model)."""
    judge = judge_from(spec)
    return lambda prompts, firsts, seconds: judge.prefer_first(list(zip(prompts, firsts, seconds)))


def make_app(kind: str, scorer: Callable[..., Sequence[float]], *, token: str, max_batch: int = 256,
             max_bytes: int = 4 << 20, timeout: float = 60.0, about: str = ""):
    """The aiohttp application serving ``scorer`` as a ``kind`` (``reward`` or ``judge``) server."""
    from aiohttp import web

    if not token:
        raise ValueError("make_app needs a non-empty token")
    path, fields, answer_key = ROUTES[kind]
    expected = f"Bearer {token}".encode()
    lock = asyncio.Lock()

    def refuse(status: int, message: str):
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return web.json_response({"error": message}, status=status, headers=headers)

    @web.middleware
    async def authenticate(request, handler):
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return refuse(401, "a bearer token is required (Authorization: Bearer TOKEN), and this one is not it")
        return await handler(request)

    async def health(request):
        return web.json_response({"ok": True, "kind": kind, "serves": about, "max_batch": max_batch})

    async def score(request):
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            return refuse(413, f"the request is over {max_bytes} bytes; send smaller batches")
        except ValueError:
            return refuse(400, "the body is not JSON")
        if not isinstance(body, dict) or any(not isinstance(body.get(f), list) for f in fields):
            return refuse(400, f"the body must be an object with the lists {', '.join(fields)}")
        columns = [body[f] for f in fields]
        n = len(columns[0])
        if any(len(c) != n for c in columns) or any(not isinstance(x, str) for c in columns for x in c):
            return refuse(400, f"{', '.join(fields)} must be lists of strings of one length")
        if n > max_batch:
            return refuse(413, f"{n} items in one request; this server scores at most {max_batch}")
        if n == 0:
            return web.json_response({answer_key: []})
        async with lock:
            try:
                values = await asyncio.wait_for(asyncio.to_thread(scorer, *columns), timeout)
            except asyncio.TimeoutError:
                return refuse(504, f"scoring {n} items took over {timeout:g} s")
            except Exception as exc:  # noqa: BLE001 - the model failed on this input: say so, keep serving
                return refuse(500, f"scoring failed: {type(exc).__name__}: {str(exc)[:200]}")
        values = [float(v) for v in values]
        if len(values) != n or not all(math.isfinite(v) for v in values):
            return refuse(500, f"the model answered {len(values)} scores for {n} items, or a non-finite one")
        return web.json_response({answer_key: values})

    app = web.Application(client_max_size=max_bytes, middlewares=[authenticate])
    app.router.add_post(path, score)
    app.router.add_get("/v1/health", health)
    return app


def serve(kind: str, target: str, *, token: str, host: str = "127.0.0.1", port: int = 8000, max_batch: int = 256,
          max_bytes: int = 4 << 20, timeout: float = 60.0, print_fn: Callable[[str], Any] = print) -> None:
    """Load ``target`` and serve it until interrupted."""
    from aiohttp import web

    scorer = reward_scorer(target) if kind == "reward" else judge_scorer(target)
    app = make_app(kind, scorer, token=token, max_batch=max_batch, max_bytes=max_bytes, timeout=timeout,
                   about=str(target))
    print_fn(f"offline-plugins: serving {kind} {target} on http://{host}:{port} (POST {ROUTES[kind][0]}, bearer "
             f"token required; at most {max_batch} items and {max_bytes} bytes a request, {timeout:g} s each)")
    web.run_app(app, host=host, port=port, print=None, handle_signals=True)
