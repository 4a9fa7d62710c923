"""VLM judge end to end against a local stub of an OpenAI-compatible chat-completions server.

The stub (conftest's ``stub``, ``helpers.StubChatHandler``) listens on 127.0.0.1 (an ephemeral port), decodes the PNG each request carries and
answers "Score: 10 x mean brightness", so a correct client gets each image's brightness back.
Per-test behaviours (slow, garbage, HTTP errors) are queued on the server; every wait is bounded.
"""
import logging
import time

import pytest
import torch

from flowrl import rewards
from flowrl.rewards.vlm import VLMJudgeError, VLMReplyError

API_KEY = "sk-test-0123456789-never-log-me"


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)


def judge(stub, monkeypatch, **kw):
    monkeypatch.setenv("FLOWRL_TEST_JUDGE_KEY", API_KEY)
    kw = {"api_key_env": "FLOWRL_TEST_JUDGE_KEY", "timeout": 2.0, "retries": 1, "backoff": 0.01, **kw}
    return rewards.build("vlm_judge", url=f"http://127.0.0.1:{stub.server_port}/v1", model="stub-vlm", **kw)


def grey_images(levels, size=24):
    return torch.stack([torch.full((3, size, size), v) for v in levels])  # [B, 3, H, W]


def test_end_to_end_scores_each_image_with_its_prompt(stub, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    reward = judge(stub, monkeypatch, concurrency=3)
    levels = [0.2, 0.9, 0.5, 0.7]
    prompts = [f"prompt number {i}" for i in range(4)]
    s = reward(grey_images(levels), prompts)
    assert s.shape == (4,) and s.dtype == torch.float32
    torch.testing.assert_close(s, torch.tensor(levels), atol=0.01, rtol=0)  # order kept under concurrency
    assert len(stub.requests) == 4
    for r in stub.requests:
        assert r["path"] == "/v1/chat/completions"
        assert r["auth"] == f"Bearer {API_KEY}"
        assert r["body"]["model"] == "stub-vlm" and r["body"]["temperature"] == 0.0
    parts = [p for r in stub.requests for p in r["body"]["messages"][-1]["content"]]
    texts = sorted(p["text"] for p in parts if p["type"] == "text")
    assert all(f"Caption: prompt number {i}" in texts[i] for i in range(4))
    assert API_KEY not in caplog.text and API_KEY not in repr(reward)


def test_timeout_is_retried_then_succeeds(stub, monkeypatch):
    stub.modes[:] = ["slow"]
    reward = judge(stub, monkeypatch, timeout=0.3, retries=1)
    t0 = time.perf_counter()
    s = reward(grey_images([0.4]), ["a grey square"])
    assert time.perf_counter() - t0 < 5
    torch.testing.assert_close(s, torch.tensor([0.4]), atol=0.01, rtol=0)
    assert len(stub.requests) == 2


def test_timeout_exhausts_retries_with_a_clear_error(stub, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    stub.modes[:] = ["slow"] * 3
    reward = judge(stub, monkeypatch, timeout=0.3, retries=2)
    t0 = time.perf_counter()
    with pytest.raises(VLMJudgeError, match=r"failed after 3 attempts.*timed out") as err:
        reward(grey_images([0.4]), ["a grey square"])
    assert time.perf_counter() - t0 < 5
    assert len(stub.requests) == 3 and API_KEY not in str(err.value)
    assert "attempt 2/3" in caplog.text and API_KEY not in caplog.text  # retries are logged, the key is not


def test_garbage_reply_raises_a_clear_error(stub, monkeypatch):
    stub.modes[:] = ["garbage"]
    reward = judge(stub, monkeypatch)
    with pytest.raises(VLMReplyError, match="no score in the judge's reply.*cannot rate images"):
        reward(grey_images([0.4]), ["a grey square"])
    assert len(stub.requests) == 1  # a malformed answer is not retried


def test_non_json_reply_raises_and_nan_mode_scores_nan(stub, monkeypatch):
    stub.modes[:] = ["not_json"]
    with pytest.raises(VLMReplyError, match="not JSON.*gateway error"):
        judge(stub, monkeypatch)(grey_images([0.4]), ["x"])
    stub.modes[:] = ["garbage"]
    s = judge(stub, monkeypatch, on_invalid="nan", concurrency=1)(grey_images([0.4, 0.6]), ["x", "y"])
    assert torch.isnan(s[0]) and abs(s[1].item() - 0.6) < 0.01


def test_out_of_range_score_is_malformed(stub, monkeypatch):
    reward = judge(stub, monkeypatch, score_range=(0.0, 5.0))  # the stub answers up to 10
    with pytest.raises(VLMReplyError, match="outside score_range"):
        reward(grey_images([0.9]), ["bright"])


def test_server_errors_retry_but_auth_errors_do_not(stub, monkeypatch):
    stub.modes[:] = ["http500"]
    s = judge(stub, monkeypatch)(grey_images([0.3]), ["x"])
    assert abs(s.item() - 0.3) < 0.01 and len(stub.requests) == 2
    stub.modes[:] = ["http401"]
    with pytest.raises(VLMJudgeError, match="HTTP 401") as err:
        judge(stub, monkeypatch, retries=3)(grey_images([0.3]), ["x"])
    assert len(stub.requests) == 3 and API_KEY not in str(err.value)


def test_unreachable_endpoint(monkeypatch):
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reward = rewards.build("vlm_judge", url=f"http://127.0.0.1:{port}/v1", timeout=0.5, retries=1, backoff=0.01)
    with pytest.raises(VLMJudgeError, match="failed after 2 attempts"):
        reward(grey_images([0.5]), ["x"])


def test_config_errors(monkeypatch):
    monkeypatch.delenv("FLOWRL_UNSET_KEY", raising=False)
    with pytest.raises(ValueError, match="FLOWRL_UNSET_KEY"):
        rewards.build("vlm_judge", url="http://127.0.0.1:1/v1", api_key_env="FLOWRL_UNSET_KEY")
    with pytest.raises(ValueError, match="http"):
        rewards.build("vlm_judge", url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="{prompt}"):
        rewards.build("vlm_judge", url="http://127.0.0.1:1", template="no placeholder")
    r = rewards.build("vlm_judge", url="http://127.0.0.1:1/v1/chat/completions/")
    assert r.endpoint == "http://127.0.0.1:1/v1/chat/completions"
    assert r.parse_score("looks fine. SCORE: 7.5") == 0.75 and r.parse_score(" 3 ") == 0.3
