"""Time to first token of one long prompt through `headroom serve`, as a new user meets it.

    python bench/bench_serve_ttft.py [--model smollm2-135m] [--prompt-tokens 1250] [--max-tokens 4]
                                     [--http-port 28410] [-- EXTRA headroom serve FLAGS]

Starts `headroom serve` (two replicas by default, as a new user runs it), waits until /health
answers 200 (a replica runs), then sends streaming `/v1/completions` requests of about --prompt-tokens tokens of text
and times each to its first streamed token from the client's side: "cold" is the first request
the cluster serves, "fresh" another prompt of the same length (nothing cached, everything warm),
"cached" the cold prompt again (its prefix in a replica's cache). Stops the cluster at the end.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def prompt_text(tokenizer, num_tokens: int, seed: int) -> str:
    """Words drawn at random until the text encodes to num_tokens tokens (or one past)."""
    rng = random.Random(seed)
    words = ["river", "market", "quietly", "seven", "bright", "engine", "harbor", "painted", "winter", "signal",
             "copper", "lantern", "orchard", "distant", "folded", "thunder", "velvet", "glacier", "marble", "echo"]
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < num_tokens:
        text += " " + " ".join(rng.choice(words) for _ in range(32))
    while len(tokenizer.encode(text, add_special_tokens=False)) > num_tokens:
        text = text.rsplit(" ", 1)[0]
    return text


def first_token_seconds(port: int, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(seconds from sending the request to its first streamed token, the prompt's token count)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
    first = None
    prompt_tokens = 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
            first = time.perf_counter() - start
        if chunk.get("usage"):
            prompt_tokens = chunk["usage"]["prompt_tokens"]
    connection.close()
    return first, prompt_tokens


def wait_until_serving(process: subprocess.Popen, port: int, timeout_s: float) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"headroom serve exited with {process.returncode}")
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")  # /v1/models answers before any replica is up
            if connection.getresponse().status == 200:
                return time.perf_counter() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"headroom serve did not answer on port {port} within {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt-tokens", type=int, default=1250)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--http-port", type=int, default=28410)
    parser.add_argument("--grpc-port", type=int, default=28411)
    parser.add_argument("serve_flags", nargs="*", help="more `headroom serve` flags (after --)")
    args = parser.parse_args()

    from replica.model.registry import resolve_model_path
    from replica.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(resolve_model_path(args.model))
    cold_prompt, fresh_prompt = (prompt_text(tokenizer, args.prompt_tokens, seed) for seed in (0, 1))
    command = [sys.executable, "-m", "cluster.cli", "serve", "--model", args.model, "--http-port",
               str(args.http_port), "--grpc-port", str(args.grpc_port), *args.serve_flags]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        ready_s = wait_until_serving(process, args.http_port, timeout_s=600)
        print(f"headroom serve {' '.join(command[4:])}: serving after {ready_s:.1f} s")
        for label, prompt in (("cold (first request)", cold_prompt), ("fresh (new prompt, warm)", fresh_prompt),
                              ("cached (the first prompt again)", cold_prompt)):
            seconds, prompt_tokens = first_token_seconds(args.http_port, args.model, prompt, args.max_tokens)
            print(f"  TTFT {label:<32} {prompt_tokens:>6} prompt tokens  {seconds:7.3f} s", flush=True)
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
        print(f"(cluster stopped; {time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
