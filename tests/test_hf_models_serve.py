"""Qwen2, Qwen3 and Gemma 3 from HF directories (tiny random models saved by transformers), each
served by `specserve serve` in its own process and asked through the openai client: greedy
completions and chats are transformers' argmax tokens; a model without a chat template answers chat
with a 400."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import openai
import pytest
import torch

from tiny_model import make_tiny_hf_model


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:  # (all bound at once: n different ports)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _greedy(hf, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        for _ in range(n):
            ids = ids + [int(hf(torch.tensor([ids])).logits[0, -1].argmax())]
    return ids[-n:]


KINDS = ["qwen2", "qwen3", "gemma3"]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The three servers, started at once (their start-ups overlap): kind -> (process, port, transformers model)."""
    started = {}
    try:
        for kind, port in zip(KINDS, _free_ports(len(KINDS))):
            path = str(tmp_path_factory.mktemp("hf") / kind)
            hf = make_tiny_hf_model(path, kind)
            env = dict(os.environ, OMP_NUM_THREADS="1")
            cmd = [sys.executable, "-m", "specserve.cli", "serve", "--model", path, "--port", str(port),
                   "--num-kv-blocks", "64", "--max-model-len", "128", "--dtype", "float32"]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            started[kind] = (proc, port, hf)
        yield started
    finally:
        for proc, _, _ in started.values():
            proc.terminate()
        for proc, _, _ in started.values():
            proc.wait(timeout=30)


@pytest.mark.parametrize("kind", KINDS)
def test_served_from_hf_directory(kind: str, servers) -> None:
    proc, port, hf = servers[kind]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, proc.stderr.read()
        try:
            model = client.models.list().data[0].id
            break
        except openai.APIConnectionError:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.5)
    prompt = [5, 17, 33, 2, 9, 40, 44, 7, 8, 61, 3, 12]  # past the tiny Gemma's window of 8
    r = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text.split() == [f"t{i}" for i in _greedy(hf, prompt, 10)]
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 10
    chat = [{"role": "user", "content": "t5 t6 t7"}]
    if kind == "gemma3":  # a base model: no chat template
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model=model, messages=chat, max_tokens=4)
        # a text prompt gets the tokenizer's BOS (Gemma's text without it is far from what it was trained on)
        r = client.completions.create(model=model, prompt="t5 t17 t33", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == 4
        assert r.choices[0].text.split() == [f"t{i}" for i in _greedy(hf, [1, 5, 17, 33], 6)]
    else:
        c = client.chat.completions.create(model=model, messages=chat, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert c.choices[0].message.content.split() == [f"t{i}" for i in _greedy(hf, [5, 6, 7], 6)]
