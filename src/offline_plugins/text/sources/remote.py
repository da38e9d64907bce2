"""The training side of a reward or judge server (``offline-plugins serve``): ``--reward http://HOST:PORT``.

Every request carries the bearer token, read from ``$OFFLINE_PLUGINS_TOKEN`` or from the file
``$OFFLINE_PLUGINS_TOKEN_FILE`` (never from the command line, where other users of the machine see
it). A request that fails on the way (the server not answering, a reset connection, a 5xx, a
timeout) is tried again after 0.5, 1, 2, 4 ... seconds until ``time_limit`` seconds have passed
since the first try; then the run stops with one line naming the server (its last checkpoint is
kept: ``--resume`` continues). An answer the server gives wrongly (a refused token, a malformed
body, the wrong number of scores, a score that is not a finite number) stops the run at once,
naming the server: retrying would not change it.

Standard library only (``urllib``): the trainer needs no HTTP stack of its own.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence

from offline_plugins.errors import UserError

__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "TIME_LIMIT_ENV", "RemoteError", "RemoteClient", "RemoteReward", "is_url", "read_token"]

TOKEN_ENV = "OFFLINE_PLUGINS_TOKEN"
TOKEN_FILE_ENV = "OFFLINE_PLUGINS_TOKEN_FILE"
#: seconds a request is tried for before the run stops (default 30: under the reward guard's own 60)
TIME_LIMIT_ENV = "OFFLINE_PLUGINS_REMOTE_TIME_LIMIT"


class RemoteError(UserError, ValueError):
    """A reward or judge server that cannot be used: the run stops here instead of scoring on
    (``stops_run``: the reward guard does not retry it response by response)."""

    stops_run = True


def is_url(spec: Any) -> bool:
    """Whether ``spec`` names a server: ``http://`` or ``https://``.

    >>> is_url("http://127.0.0.1:8000"), is_url("mytask.rewards:score")
    (True, False)
    """
    return str(spec).startswith(("http://", "https://"))


def read_token(*, file: Optional[str] = None, what: str = "the server") -> str:
    """The bearer token: ``file``, else ``$OFFLINE_PLUGINS_TOKEN_FILE``'s file, else ``$OFFLINE_PLUGINS_TOKEN``;
    a :class:`RemoteError` when none is set or the one set is empty."""
    path = file or os.environ.get(TOKEN_FILE_ENV)
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise RemoteError(f"{what}: the token file {path!r} cannot be read ({exc.strerror or exc})") from None
        if not token:
            raise RemoteError(f"{what}: the token file {path!r} is empty; write the token into it")
        return token
    token = os.environ.get(TOKEN_ENV, "").strip()
    if not token:
        raise RemoteError(f"{what} needs a bearer token and none is set: put it in ${TOKEN_ENV}, or in a file named by "
                          f"${TOKEN_FILE_ENV} (never on the command line)")
    return token


class RemoteClient:
    """POSTs JSON to ``url`` + a path with the bearer token, retrying what may pass (see the module).

    Args:
        url: ``http://HOST:PORT`` of an ``offline-plugins serve`` server.

    Keyword Args:
        token: the bearer token (default :func:`read_token`).
        time_limit: seconds from a request's first try after which it is given up (default
            ``$OFFLINE_PLUGINS_REMOTE_TIME_LIMIT``, else 30).
        request_timeout: seconds one try may take.
    """

    def __init__(self, url: str, *, token: Optional[str] = None, time_limit: Optional[float] = None,
                 request_timeout: float = 20.0) -> None:
        if not is_url(url):
            raise RemoteError(f"{url!r} is no server address; give http://HOST:PORT")
        self.url = url.rstrip("/")
        self.token = token if token is not None else read_token(what=f"the server {self.url}")
        if time_limit is None:
            try:
                time_limit = float(os.environ.get(TIME_LIMIT_ENV, "30"))
            except ValueError:
                raise RemoteError(f"${TIME_LIMIT_ENV} must be seconds, got {os.environ[TIME_LIMIT_ENV]!r}") from None
        self.time_limit, self.request_timeout = float(time_limit), min(float(request_timeout), float(time_limit))
        self.retries = 0  #: tries made again, over the client's life

    def post(self, path: str, payload: dict) -> dict:
        body = json.dumps(payload).encode()
        started, wait, last = time.monotonic(), 0.5, ""
        while True:
            request = urllib.request.Request(f"{self.url}{path}", data=body, method="POST", headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {self.token}"})
            try:
                with urllib.request.urlopen(request, timeout=self.request_timeout) as response:
                    raw = response.read()
                break
            except urllib.error.HTTPError as exc:
                detail = _error_text(exc)
                if exc.code == 401:
                    raise RemoteError(f"the server {self.url} refused the token (401: {detail}); set the token it was "
                                      f"started with in ${TOKEN_ENV} or ${TOKEN_FILE_ENV}") from None
                if exc.code < 500:
                    raise RemoteError(f"the server {self.url} refused the request ({exc.code}: {detail})") from None
                last = f"{exc.code}: {detail}"
            except (urllib.error.URLError, OSError, TimeoutError) as exc:
                last = str(getattr(exc, "reason", exc))
            if time.monotonic() - started + wait > self.time_limit:
                raise RemoteError(f"the server {self.url} did not answer within {self.time_limit:g} s ({last}); the run "
                                  "stopped there: start the server again and --resume continues from the last "
                                  "checkpoint")
            time.sleep(wait)
            self.retries += 1
            wait = min(wait * 2, 8.0)
        try:
            answer = json.loads(raw)
        except ValueError:
            raise RemoteError(f"the server {self.url} answered {path} with something that is not JSON "
                              f"({raw[:60]!r}); is it an offline-plugins server?") from None
        if not isinstance(answer, dict):
            raise RemoteError(f"the server {self.url} answered {path} with a {type(answer).__name__}, not an object")
        return answer


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(exc.read()).get("error", exc.reason))[:200]
    except Exception:  # noqa: BLE001 - any body: the status line says enough
        return str(exc.reason)


def checked_scores(answer: dict, key: str, n: int, server: str) -> list[float]:
    """``answer[key]``: ``n`` finite numbers, else a :class:`RemoteError` naming the server."""
    values = answer.get(key)
    if not isinstance(values, list):
        raise RemoteError(f"the server {server} answered without a {key!r} list ({str(answer)[:80]}); is it an "
                          "offline-plugins server of the right kind?")
    if len(values) != n:
        raise RemoteError(f"the server {server} answered {len(values)} {key} for {n} inputs")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise RemoteError(f"the server {server} answered {v!r:.40} as {key}[{i}]; scores must be finite numbers")
        out.append(float(v))
    return out


class RemoteReward:
    """A reward function ``(prompts, responses, **columns) -> list[float]`` answered by a
    ``serve reward`` server (``POST /v1/score``).

    >>> RemoteReward("ftp://x")
    Traceback (most recent call last):
    ...
    offline_plugins.text.sources.remote.RemoteError: 'ftp://x' is no server address; give http://HOST:PORT
    """

    def __init__(self, url: str, **client: Any) -> None:
        self.client = RemoteClient(url, **client)
        self.__name__ = self.url = self.client.url

    def __call__(self, prompts: Sequence[str], responses: Sequence[str], **_: Any) -> list[float]:
        answer = self.client.post("/v1/score", {"prompts": list(prompts), "responses": list(responses)})
        return checked_scores(answer, "scores", len(prompts), self.url)
