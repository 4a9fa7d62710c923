"""`flowrl serve-reward` and the `remote` reward, on loopback only: the same rewards as local scoring,
batching of concurrent requests, and every bad input or fault on both sides with an error that
names what is wrong (bounded: every client here times out within seconds)."""
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from helpers_reward_server import free_port, remote_kwargs, served, stub

from flowrl import rewards
from flowrl.rewards._wire import WireError, decode_response, encode_request
from flowrl.rewards.remote import RemoteRewardError

PROMPTS = [f"a handwritten digit {d}" for d in (3, 1, 4, 1, 5)] + ["a cat"]  # the last: NaN (no digit)


def images(n=6, seed=0):
    return torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))  # [n, 3, 16, 16]


def same(a, b) -> bool:
    """Bit for bit, NaN included."""
    return a.shape == b.shape and torch.equal(a.nan_to_num(nan=-7.0), b.nan_to_num(nan=-7.0)) \
        and torch.equal(a.isnan(), b.isnan())


def post(url, body: bytes, content_type="application/octet-stream", headers=None):
    """(status, JSON) of a raw POST to /score."""
    req = urllib.request.Request(url + "/score", data=body, method="POST",
                                 headers={"Content-Type": content_type, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---------------------------------------------------------------- the same rewards
def test_remote_gives_the_local_rewards(tiny_digits_dir):
    local = rewards.build("digits")
    x = images()
    eight_bit = (x * 255).round() / 255  # what uint8 and PNG payloads carry
    with served("digits") as url:
        exact = rewards.build("remote", **remote_kwargs(url, encoding="float32"))
        assert exact.served == "digits"
        r = exact(x, PROMPTS)
        assert same(r, local(x, PROMPTS)) and torch.isnan(r[-1])  # bit for bit, NaN kept
        for enc in ("uint8", "png"):
            assert same(rewards.build("remote", **remote_kwargs(url, encoding=enc))(x, PROMPTS),
                        local(eight_bit, PROMPTS))
        small = rewards.build("remote", **remote_kwargs(url, encoding="float32", batch_size=4))  # 2 requests
        # rows scored in batches of 4 and 2 instead of 6: the classifier's matrix products may take other kernels
        # for other batch sizes (float32 round-off, on some CPUs and thread counts), never other values
        torch.testing.assert_close(small(x, PROMPTS), local(x, PROMPTS), rtol=1e-5, atol=1e-7, equal_nan=True)
        mixed = rewards.build_multi({"remote": 1.0, "jpeg_compressibility": 0.5},
                                    {"remote": remote_kwargs(url, encoding="float32")})
        want = local(x, PROMPTS) + 0.5 * rewards.build("jpeg_compressibility")(x, PROMPTS)
        assert same(mixed(x, PROMPTS), want)


def test_concurrent_requests_are_merged_and_each_gets_its_own_scores(tiny_digits_dir):
    local = rewards.build("digits")
    batches = [images(6, seed=s) for s in range(4)]
    out = [None] * 4
    with served("digits", max_wait=0.5) as url:
        remote = rewards.build("remote", **remote_kwargs(url, encoding="float32"))
        start = threading.Barrier(4)

        def rank(i):
            start.wait()
            out[i] = remote(batches[i], PROMPTS)

        threads = [threading.Thread(target=rank, args=(i,)) for i in range(4)]
        [t.start() for t in threads]
        [t.join(30) for t in threads]
        stats = remote.health()
    for i in range(4):
        assert torch.allclose(out[i], local(batches[i], PROMPTS), atol=1e-6, equal_nan=True)
    assert stats["requests"] == 4 and stats["reward_calls"] < 4 and stats["largest_call"] > 6  # merged


def test_user_callable_and_options(tmp_path, monkeypatch):
    from flowrl.rewards.server import load_reward, parse_options

    (tmp_path / "my_scores.py").write_text(
        "import torch\n"
        "def brightness(images, prompts):\n    return images.mean(dim=(1, 2, 3))\n"
        "class Scaled:\n    def __init__(self, scale=1.0):\n        self.scale = scale\n"
        "    def __call__(self, images, prompts, **meta):\n        return self.scale * images.mean(dim=(1, 2, 3))\n")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "opts.yaml").write_text("scale: 3.0\n")
    assert parse_options(["scale=2", "{device: cpu}"]) == {"scale": 2, "device": "cpu"}
    assert parse_options([str(tmp_path / "opts.yaml")]) == {"scale": 3.0}
    with pytest.raises(ValueError, match=r"expected key=value, a YAML \(or JSON\) mapping"):
        parse_options(["[1, 2]"])
    x = images()
    assert torch.equal(load_reward("my_scores:brightness")(x, PROMPTS), x.mean(dim=(1, 2, 3)))
    scaled = load_reward("my_scores:Scaled", {"scale": 2.0})
    with served(scaled) as url:
        got = rewards.build("remote", **remote_kwargs(url, encoding="float32"))(x, PROMPTS)
    assert torch.allclose(got, 2 * x.mean(dim=(1, 2, 3)))
    with pytest.raises(ValueError, match="cannot load 'no_such_module:f'"):
        load_reward("no_such_module:f")
    with pytest.raises(ValueError, match="unknown reward 'digitz'"):
        load_reward("digitz")


# ---------------------------------------------------------------- bad requests: 4xx naming the field
class Picky:
    """Raises for a prompt 'reject', returns the wrong shape for 'short', crashes for 'crash'."""

    name = "picky"

    def __call__(self, images, prompts, **meta):
        if "reject" in prompts:
            raise ValueError("prompt 'reject' is not allowed")
        if "crash" in prompts:
            raise RuntimeError("out of GPU memory")
        if "short" in prompts:
            return torch.zeros(len(prompts) - 1)
        return images.mean(dim=(1, 2, 3))


def test_bad_requests_get_a_4xx_naming_the_field():
    from safetensors.torch import save

    x = images(2)
    good = encode_request(x, ["a", "b"], encoding="float32")

    def body(tensors, head):
        return save(tensors, metadata={"flowrl": json.dumps(head)} if head is not None else None)

    head = {"version": 1, "encoding": "float32", "prompts": ["a", "b"], "meta": {}, "image_meta": []}
    nan = x.clone()
    nan[0, 0, 0, 0] = float("nan")
    cases = [
        (good, "text/plain", 415, "Content-Type"),
        (b"not a safetensors file at all", None, 400, "body"),
        (body({"images": x}, None), None, 400, "metadata.flowrl"),
        (body({"images": x}, {**head, "version": 9}), None, 400, "version"),
        (body({"images": x}, {**head, "encoding": "jpeg"}), None, 400, "encoding"),
        (body({"images": x}, {**head, "prompts": "a"}), None, 400, "prompts"),
        (body({"images": x}, {**head, "prompts": ["a", "b", "c"]}), None, 400, "images"),  # wrong length
        (body({"images": nan}, head), None, 400, "images"),  # NaN-carrying
        (body({"images": x * 2}, head), None, 400, "images"),  # outside [0, 1]
        (body({"images": x.half()}, head), None, 400, "images"),
        (body({"images": x, "extra": x.clone()}, head), None, 400, "extra"),
        (body({"images.png.0": torch.tensor([1, 2, 3], dtype=torch.uint8),
               "images.png.1": torch.tensor([1], dtype=torch.uint8)}, {**head, "encoding": "png"}), None, 400,
         "images.png.0"),  # not a PNG file
        (body({"images": x}, {**head, "meta": {"x": 1}, "image_meta": ["src"]}), None, 400, "meta.src"),  # missing
    ]
    with served(Picky(), max_request_mb=0.05, max_images=8) as url:
        for i, (b, ctype, status, field) in enumerate(cases):
            code, err = post(url, b, ctype or "application/octet-stream")
            assert (code, err["field"]) == (status, field), (i, code, err)
            assert field.split(".")[0] in err["error"] or field == "Content-Type", err
        big = encode_request(torch.rand(3, 3, 64, 64), ["a"] * 3, encoding="float32")  # 147 kB > 50 kB
        assert post(url, big)[0] == 413 and "limit" in post(url, big)[1]["error"]
        many = encode_request(torch.rand(9, 3, 4, 4), ["a"] * 9, encoding="float32")
        assert post(url, many) == (400, {"error": "prompts: 9 images exceed the server's limit of 8 per request",
                                         "field": "prompts"})
        code, err = post(url, encode_request(x, ["reject", "b"]))
        assert code == 422 and "prompt 'reject' is not allowed" in err["error"]
        code, err = post(url, encode_request(x, ["short", "b"]))
        assert code == 500 and err["field"] == "rewards" and "shape (1,)" in err["error"]
        code, err = post(url, encode_request(x, ["crash", "b"]))
        assert code == 500 and "RuntimeError: out of GPU memory" in err["error"]
        assert post(url, good)[0] == 200  # and the server still serves
        remote = rewards.build("remote", **remote_kwargs(url))
        with pytest.raises(RemoteRewardError, match="HTTP 422.*prompt 'reject' is not allowed"):
            remote(x, ["reject", "b"])


def test_bearer_token(monkeypatch):
    monkeypatch.setenv("FLOWRL_TEST_TOKEN", "s3cret")
    x = images(2)
    with served(Picky(), token_env="FLOWRL_TEST_TOKEN") as url:
        assert post(url, encode_request(x, ["a", "b"]))[0] == 401
        assert post(url, encode_request(x, ["a", "b"]), headers={"Authorization": "Bearer wrong"})[0] == 401
        assert rewards.build("remote", **remote_kwargs(url, token_env="FLOWRL_TEST_TOKEN"))(x, ["a", "b"]).shape == (2,)
        with pytest.raises(RemoteRewardError, match="HTTP 401.*bearer token"):
            rewards.build("remote", **remote_kwargs(url))(x, ["a", "b"])
        assert "s3cret" not in repr(rewards.build("remote", **remote_kwargs(url, token_env="FLOWRL_TEST_TOKEN")))
    monkeypatch.delenv("FLOWRL_TEST_TOKEN")
    with pytest.raises(ValueError, match="FLOWRL_TEST_TOKEN"):
        with served(Picky(), token_env="FLOWRL_TEST_TOKEN"):
            pass


# ---------------------------------------------------------------- bad responses and faults: the client
def test_bad_responses_are_errors_naming_the_field():
    from starlette.responses import Response

    replies = iter([b"<html>oops</html>", b'{"scores": [1, 2]}', b'{"rewards": [1]}', b'{"rewards": [NaN, 1]}',
                    b'{"rewards": ["a", 1]}', b'{"rewards": [1, 2], "components": []}'])

    async def handler(request):
        await request.body()
        return Response(next(replies), media_type="application/json")

    x = images(2)
    with stub(handler) as url:
        remote = rewards.build("remote", **remote_kwargs(url))
        for match in ("response: not JSON", "rewards: missing", "rewards: 1 values for 2 images",
                      "NaN is not JSON", "rewards: expected numbers or null", "components: expected an object"):
            with pytest.raises(RemoteRewardError, match=match):
                remote(x, ["a", "b"])
    with pytest.raises(WireError, match="rewards: 3 values for 2 images"):
        decode_response(b'{"rewards": [1, 2, 3]}', 2)


def test_refused_slow_and_flaky_servers():
    from starlette.responses import JSONResponse

    x = images(2)
    port = free_port()  # nothing listens there
    t = time.monotonic()
    with pytest.raises(RemoteRewardError, match=rf"127.0.0.1:{port}/health: connection refused.*serve-reward"):
        rewards.build("remote", **remote_kwargs(f"http://127.0.0.1:{port}"))
    assert time.monotonic() - t < 10

    calls = {"n": 0}

    async def slow_then_flaky(request):
        import asyncio

        await request.body()
        calls["n"] += 1
        if request.query_params.get("mode") == "slow" or calls["n"] <= 2:
            await asyncio.sleep(1.5)
            return JSONResponse({"rewards": [0.0, 0.0]})
        if calls["n"] == 3:
            return JSONResponse({"error": "busy", "field": "reward"}, status_code=503)
        return JSONResponse({"rewards": [0.25, None]})

    with stub(slow_then_flaky) as url:
        slow = rewards.build("remote", url=url, timeout=0.5, retries=1, backoff=0.01)
        with pytest.raises(RemoteRewardError, match="failed after 2 attempts.*timed out after 0.5 s"):
            slow(x, ["a", "b"])  # calls 1 and 2 time out
        flaky = rewards.build("remote", url=url, timeout=5, retries=2, backoff=0.01)
        r = flaky(x, ["a", "b"])  # call 3: 503, retried; call 4 answers
        assert r[0] == 0.25 and torch.isnan(r[1]) and calls["n"] == 4


def test_server_killed_mid_request_then_back(tiny_digits_dir, tmp_path):
    """A `flowrl serve-reward` process killed while it scores: the client's retries fail with the URL
    and the cause; restarted on the same port, the same client scores again."""
    import os

    from flowrl.rewards.server_process import spawn

    (tmp_path / "slow_digits.py").write_text(
        "import time\nfrom flowrl.rewards.digits import DigitsReward\n"
        "class Slow(DigitsReward):\n    def __call__(self, images, prompts, **meta):\n"
        "        time.sleep(float(__import__('os').environ.get('SLOW', '0')))\n"
        "        return super().__call__(images, prompts, **meta)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "SLOW": "30"}
    port = free_port()
    server = spawn("slow_digits:Slow", port=port, env=env)
    remote = rewards.build("remote", url=server.url, timeout=20, retries=1, backoff=0.2)
    errors = []

    def call():
        try:
            remote(images(), PROMPTS)
        except RemoteRewardError as e:
            errors.append(str(e))

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(1.0)  # the request is in the reward now (it sleeps 30 s)
    server.stop(kill=True)
    caller.join(60)
    assert len(errors) == 1 and server.url in errors[0] and "after 2 attempts" in errors[0], errors
    with spawn("slow_digits:Slow", port=port, env={**env, "SLOW": "0"}) as back:
        assert back.url == server.url
        assert torch.allclose(remote(images(), PROMPTS), rewards.build("digits")((images() * 255).round() / 255,
                                                                                  PROMPTS), equal_nan=True)


def test_cli_errors_are_one_line(capsys):
    from flowrl.cli import main

    assert main(["serve-reward", "digitz"]) == 2
    assert "unknown reward 'digitz'" in capsys.readouterr().err
    assert main(["serve-reward", "digits", "--token-env", "FLOWRL_NO_SUCH_VARIABLE"]) == 2
    assert "FLOWRL_NO_SUCH_VARIABLE" in capsys.readouterr().err
    assert main(["serve-reward", "digits", "--options", "[1]"]) == 2
    assert "expected key=value, a YAML (or JSON) mapping" in capsys.readouterr().err
