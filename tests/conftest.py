"""Shared test set-up: one thread, a private Minari store, no user plugin block list."""

from __future__ import annotations

import os

import pytest

# Tests must not depend on the user's block list or Minari store.
os.environ.pop("OFFLINE_PLUGINS_DISABLE", None)
# Never reach for Minari's remote server from tests: unknown ids fail at once.
os.environ["OFFLINE_PLUGINS_OFFLINE"] = "1"
# SFT references and reference log-probs go to a private cache, not the user's.
import tempfile  # noqa: E402

os.environ["OFFLINE_PLUGINS_CACHE"] = tempfile.mkdtemp(prefix="offline-plugins-cache-")

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover
    pass


@pytest.fixture(scope="session")
def prompt_file(tmp_path_factory):
    """220 prompts of four random letters (``_text_rewards.write_letter_prompts``), for the online tests'
    runs on a prompt file with ``--reward _text_rewards:digit_share``."""
    from _text_rewards import write_letter_prompts

    return write_letter_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


@pytest.fixture
def preference_pairs(tmp_path, monkeypatch):
    """``load(rows)``: the ``preference-pairs`` data of ``rows`` (prompt, chosen, rejected), written to
    ``tmp_path/pairs.jsonl``; the reference log-probs are cached under ``tmp_path/cache``."""
    import json

    from offline_plugins.text.data.preference_sources import load_preference_source

    monkeypatch.setenv("OFFLINE_PLUGINS_CACHE", str(tmp_path / "cache"))

    def load(rows: list[dict]):
        path = tmp_path / "pairs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return load_preference_source(str(path), kind="preference-pairs", progress=False)

    return load


@pytest.fixture(scope="session")
def tiny_prm(tmp_path_factory):
    """The folder of a PRM trained 3 steps on ``steps/arithmetic-v0``, made once a test run, for the
    tests of the RL algorithms that read one (``--set prm=DIR``)."""
    from offline_plugins.cli import main

    out = tmp_path_factory.mktemp("tiny-prm") / "prm"
    code = main(["train", "prm", "--dataset", "steps/arithmetic-v0", "--steps", "3", "--seed", "0",
                 "--set", "batch_size=8", "--out", str(out), "--no-progress"])
    assert code == 0, "training the tests' tiny PRM failed (its error is in the captured stderr above)"
    return out


@pytest.fixture(scope="session")
def minari_store(tmp_path_factory):
    """A Minari datasets folder private to this test session (MINARI_DATASETS_PATH)."""
    path = tmp_path_factory.mktemp("minari")
    old = os.environ.get("MINARI_DATASETS_PATH")
    os.environ["MINARI_DATASETS_PATH"] = str(path)
    yield path
    if old is None:
        os.environ.pop("MINARI_DATASETS_PATH", None)
    else:
        os.environ["MINARI_DATASETS_PATH"] = old


def _bwrap_problem() -> str:
    from offline_plugins.text.tools.sandbox import BwrapSandbox, SandboxUnavailable

    try:
        BwrapSandbox().check()
    except SandboxUnavailable as exc:
        return str(exc)
    return ""


def pytest_collection_modifyitems(config, items):
    # tests of the Python tool's sandbox skip where bubblewrap cannot run, but never in CI: there .ci/run
    # installs it, and a skip would hide that the sandbox no longer works
    if any("bwrap" in item.keywords for item in items) and not os.environ.get("CI"):
        problem = _bwrap_problem()
        if problem:
            skip_bwrap = pytest.mark.skip(reason=f"bubblewrap cannot run here: {problem[:200]}")
            for item in items:
                if "bwrap" in item.keywords:
                    item.add_marker(skip_bwrap)
    # tests of --generator vllm skip where vLLM is not installed (the main venv), but never in CI: there they
    # run in vLLM's own venv (scripts/test_vllm.sh), the main suite deselects them (-m "not vllm"), and a skip
    # would hide that the engine is no longer tested (their vllm fixture fails instead)
    if not os.environ.get("CI") and any(item.get_closest_marker("vllm") for item in items):
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            skip_vllm = pytest.mark.skip(reason="needs vLLM: run it in the venv of scripts/test_vllm.sh")
            for item in items:
                if item.get_closest_marker("vllm"):
                    item.add_marker(skip_vllm)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def vllm():
    """The vllm module, for the tests marked vllm. Where vLLM is missing those tests are skipped before this
    runs, except in CI (CI=true), where a skip would hide that vLLM is no longer tested: there they fail here."""
    try:
        import vllm
    except ImportError as exc:
        pytest.fail(f"CI is set and vLLM cannot be imported ({exc}): run the vLLM tests in the environment "
                    "scripts/test_vllm.sh makes", pytrace=False)
    return vllm
