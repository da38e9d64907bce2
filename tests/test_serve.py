"""``offline-plugins serve`` and ``--reward http://...`` on loopback: the served scores are the
in-process model's, every request needs the token, oversized and malformed traffic is refused, and a
server that goes away stops the run cleanly with its checkpoint kept."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading

import pytest

pytest.importorskip("aiohttp")

from offline_plugins.cli import main  # noqa: E402
from offline_plugins.eval.serve import make_app  # noqa: E402
from offline_plugins.text.sources.remote import RemoteError, RemoteReward  # noqa: E402

TOKEN = "a-test-token-of-some-length-0123456789"


@contextlib.contextmanager
def served(app):
    """``app`` on 127.0.0.1 at a free port, in a thread of its own; yields its URL; stops it after."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    box = {}

    async def start():
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["port"] = site._server.sockets[0].getsockname()[1]

    ready = threading.Event()

    def run():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)
    stopped = {"done": False}

    def stop():
        if not stopped["done"]:
            stopped["done"] = True
            asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)

    box["stop"] = stop
    try:
        yield f"http://127.0.0.1:{box['port']}", stop
    finally:
        stop()


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """A reward model trained 3 steps on 60 pairs (its scores, not its accuracy, are what is compared)."""
    root = tmp_path_factory.mktemp("rm")
    r = random.Random(0)
    rows = []
    for _ in range(60):
        a, b = r.randint(10, 99), r.randint(10, 99)
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + r.choice([-2, -1, 1, 2]))})
    (root / "pairs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    assert main(["train", "reward-model", "--dataset", str(root / "pairs.jsonl"), "--model", "tiny", "--steps", "3",
                 "--out", str(root / "out"), "--no-progress"]) == 0
    return root / "out"


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("OFFLINE_PLUGINS_TOKEN", TOKEN)
    monkeypatch.delenv("OFFLINE_PLUGINS_TOKEN_FILE", raising=False)
    monkeypatch.setenv("OFFLINE_PLUGINS_REMOTE_TIME_LIMIT", "3")
    return TOKEN


def _post(url, body: bytes, headers: dict) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "application/json",
                                                                             **headers})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_served_scores_are_the_in_process_models(reward_dir, token):
    from offline_plugins.eval.serve import reward_scorer
    from offline_plugins.text.sources.prompts import load_reward_function

    prompts, responses = ["12+30=", "7+8=", "55+44="], ["42", "16", "99"]
    local = load_reward_function(str(reward_dir))(prompts, responses)
    with served(make_app("reward", reward_scorer(str(reward_dir)), token=token)) as (url, _):
        remote = load_reward_function(url)
        assert isinstance(remote, RemoteReward)
        assert remote(prompts, responses) == [float(x) for x in local]


def test_no_token_a_wrong_token_and_oversized_requests_are_refused(token):
    body = json.dumps({"prompts": ["1+1="], "responses": ["2"]}).encode()
    app = make_app("reward", lambda p, r: [1.0] * len(p), token=token, max_batch=4, max_bytes=2000)
    with served(app) as (url, _):
        assert _post(f"{url}/v1/score", body, {})[0] == 401
        status, answer = _post(f"{url}/v1/score", body, {"Authorization": "Bearer wrong"})
        assert status == 401 and "bearer token" in answer["error"]
        assert _post(f"{url}/v1/score", body, {"Authorization": f"Bearer {token}"}) == (200, {"scores": [1.0]})
        five = json.dumps({"prompts": ["a"] * 5, "responses": ["b"] * 5}).encode()
        status, answer = _post(f"{url}/v1/score", five, {"Authorization": f"Bearer {token}"})
        assert status == 413 and "at most 4" in answer["error"]
        big = json.dumps({"prompts": ["x" * 3000], "responses": ["y"]}).encode()
        assert _post(f"{url}/v1/score", big, {"Authorization": f"Bearer {token}"})[0] == 413
        status, answer = _post(f"{url}/v1/score", b'{"prompts": ["a"]}', {"Authorization": f"Bearer {token}"})
        assert status == 400 and "prompts, responses" in answer["error"]
        with pytest.raises(RemoteError, match="refused the token"):
            RemoteReward(url, token="wrong")(["1+1="], ["2"])
        with pytest.raises(RemoteError, match=r"refused the request \(413: 5 items"):
            RemoteReward(url)(["a"] * 5, ["b"] * 5)


@pytest.mark.parametrize("answer, match", [
    ({"scores": [1.0]}, "answered 1 scores for 2 inputs"),
    ({"scores": [1.0, float("nan")]}, "must be finite numbers"),
    ({"rewards": [1.0, 2.0]}, "without a 'scores' list"),
])
def test_a_server_that_answers_wrongly_is_refused_naming_it(token, answer, match):
    from aiohttp import web

    async def wrong(request):
        return web.Response(text=json.dumps(answer).replace("NaN", "NaN"), content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/score", wrong)
    with served(app) as (url, _):
        with pytest.raises(RemoteError, match=f"the server {url} .*{match}"):
            RemoteReward(url)(["1+1=", "2+2="], ["2", "4"])


def test_a_server_that_does_not_answer_is_retried_until_the_time_limit(token):
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = RemoteReward(f"http://127.0.0.1:{port}", time_limit=2.0)
    started = time.monotonic()
    with pytest.raises(RemoteError, match=r"did not answer within 2 s.*--resume continues"):
        client(["1+1="], ["2"])
    assert client.client.retries >= 2 and time.monotonic() - started < 5


def test_a_judge_server_answers_as_the_judge_in_process(token):
    from offline_plugins.eval.judge import RemoteJudge, judge_from

    def shorter(prompts, firsts, seconds):
        return [0.5 if len(a) == len(b) else float(len(a) < len(b)) for a, b in zip(firsts, seconds)]

    with served(make_app("judge", shorter, token=token)) as (url, _):
        judge = judge_from(url)
        assert isinstance(judge, RemoteJudge)
        assert judge.prefer_first([("p", "ab", "abc"), ("p", "abc", "ab"), ("p", "a", "b")]) == [1.0, 0.0, 0.5]


def test_a_run_scores_with_the_server_and_stops_cleanly_when_it_goes_away(reward_dir, token, tmp_path, capsys):
    from offline_plugins.eval.serve import reward_scorer

    scorer, calls = reward_scorer(str(reward_dir)), {"n": 0}
    common = ["train", "grpo", "--dataset", "arithmetic", "--model", "tiny", "--seed", "0", "--no-progress",
              "--set", "reference_sft_steps=5", "--set", "group_size=2", "--set", "prompts_per_round=2",
              "--set", "batch_size=4", "--set", "eval_prompts=4"]
    with served(make_app("reward", scorer, token=token)) as (url, stop):
        out = tmp_path / "ok"
        assert main([*common, "--reward", url, "--steps", "2", "--out", str(out)]) == 0, capsys.readouterr().err
        assert json.loads((out / "summary.json").read_text())["steps"] == 2

        def stop_after_two(prompts, responses):  # the server goes away in the middle of the run
            calls["n"] += 1
            if calls["n"] > 5:
                threading.Thread(target=stop, daemon=True).start()
                raise RuntimeError("going away")
            return scorer(prompts, responses)

    with served(make_app("reward", stop_after_two, token=token)) as (url, stop):
        out = tmp_path / "gone"
        code = main([*common, "--reward", url, "--steps", "8", "--eval-every", "2", "--out", str(out)])
        err = capsys.readouterr().err
    assert code == 2 and f"the server {url} did not answer within 3 s" in err and "--resume" in err, err
    assert "Traceback" not in err
    assert (out / "checkpoints" / "last.ckpt").is_file()  # what it trained before is kept: --resume continues


def test_a_url_without_a_token_and_serve_without_one_meet_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OFFLINE_PLUGINS_TOKEN", raising=False)
    monkeypatch.delenv("OFFLINE_PLUGINS_TOKEN_FILE", raising=False)
    assert main(["train", "grpo", "--dataset", "arithmetic", "--reward", "http://127.0.0.1:9", "--steps", "1",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "needs a bearer token and none is set" in err and "OFFLINE_PLUGINS_TOKEN" in err
    assert main(["serve", "reward", str(tmp_path)]) == 2
    assert "needs a bearer token" in capsys.readouterr().err
    short = tmp_path / "token"
    short.write_text("abc\n")
    assert main(["serve", "reward", str(tmp_path), "--token-file", str(short)]) == 2
    assert "use at least 16 random ones" in capsys.readouterr().err


def test_serve_reward_names_a_missing_folder_and_another_servers_address_in_its_own_words(tmp_path, capsys,
                                                                                          monkeypatch):
    monkeypatch.setenv("OFFLINE_PLUGINS_TOKEN", "x" * 32)
    missing = tmp_path / "no-such-run"
    assert main(["serve", "reward", str(missing)]) == 2
    err = capsys.readouterr().err
    assert (f"serve reward '{missing}': no such folder; give the OUT folder of 'offline-plugins train "
            "reward-model'") in err
    assert "--reward" not in err and "Traceback" not in err
    assert main(["serve", "reward", "http://127.0.0.1:9"]) == 2
    assert "is a server's address; serve reward loads a model on this machine" in capsys.readouterr().err
