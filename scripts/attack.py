"""Hostile and careless requests against a Tritone server: one line per case, then 'N passed, M failed'.

Each case is something a client might send to hurt others or the server (end another client's
request, pass a limit by calling an internal model directly, fail a batch with one bad request,
wrap an integer, reach an administrative API, flood tritone-openai with a body) and what the
server must answer. The internal models (preprocessing, llm, postprocessing) are public Triton
models, so they are attacked directly too. Afterwards the engine must hold no request and no KV
block. Run it with scripts/attack: against a running server (--http, --grpc, --metrics, and
--openai with --api-key), or, with none of them, against one it starts.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

import numpy as np

FORGED_KEY = b"not-the-servers-key"


@dataclass(slots=True)
class Target:
    http: str  # host:port of tritonserver's HTTP
    grpc: str
    metrics: str
    openai: str | None = None  # http://host:port of tritone-openai
    api_key: str | None = None
    model: str = ""  # the served model's name on the OpenAI API


class Failed(AssertionError):
    pass


def check(condition: bool, why: str) -> None:
    if not condition:
        raise Failed(why)


# ---- plumbing

def http_json(target: Target, method: str, path: str, body=None, headers: dict | None = None,
              base: str | None = None, timeout: float = 60.0) -> tuple[int, dict | str]:
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    request = urllib.request.Request((base or f"http://{target.http}") + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def generate(target: Target, body: dict) -> tuple[int, dict | str]:
    return http_json(target, "POST", "/v2/models/ensemble/generate", body)


def grpc_stream(target: Target, model: str, tensors: list, request_id: str = "", empty_final: bool = False):
    """Every (result, error) of one decoupled gRPC request, in order."""
    import tritonclient.grpc as grpcclient

    from tritone_client import infer_inputs

    results, done = [], threading.Event()

    def callback(result, error):
        results.append((result, error))
        if error is not None:
            done.set()
            return
        final = result.get_response().parameters.get("triton_final_response")
        if final is None or final.bool_param:
            done.set()

    client = grpcclient.InferenceServerClient(target.grpc)
    try:
        client.start_stream(callback=callback)
        params = {"triton_enable_empty_final_response": True} if empty_final else {}
        client.async_stream_infer(model, infer_inputs(grpcclient, tensors), request_id=request_id,
                                  enable_empty_final_response=True, parameters=params or None)
        done.wait(120)
        client.stop_stream()
    finally:
        client.close()
    return results


def first_error(results) -> str | None:
    return next((str(e) for _, e in results if e is not None), None)


def text_of(results) -> tuple[str, int, str]:
    """(text, output tokens, finish reason) of a streamed ensemble request."""
    text, tokens, reason = "", 0, ""
    for result, error in results:
        if error is not None:
            raise Failed(f"the request failed: {error}")
        if result.as_numpy("text_output") is None:
            continue
        text += result.as_numpy("text_output").reshape(-1)[0].decode()
        tokens = int(result.as_numpy("num_output_tokens").reshape(-1)[0])
        reason_array = result.as_numpy("finish_reason")
        if reason_array is not None:
            reason = reason_array.reshape(-1)[0].decode()
    return text, tokens, reason


def ensemble_tensors(prompt: str, max_tokens: int, stream: bool = True) -> list:
    return [("text_input", np.array([[prompt.encode()]], dtype=object), "BYTES"),
            ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
            ("end_id", np.array([[-1]], dtype=np.int32), "INT32"),
            ("stream", np.array([[stream]]), "BOOL"),
            ("apply_chat_template", np.array([[False]]), "BOOL")]


def llm_tensors(max_tokens: int = 4, **extra) -> list:
    tensors = [("INPUT_IDS", np.array([[1, 2, 3, 4]], dtype=np.int32), "INT32"),
               ("MAX_TOKENS", np.array([[max_tokens]], dtype=np.int32), "INT32")]
    for name, (array, dtype) in extra.items():
        tensors.append((name, array, dtype))
    return tensors


class Victim:
    """Another client's streamed request through the ensemble, running in a thread."""

    def __init__(self, target: Target, request_id: str, max_tokens: int = 48):
        self.max_tokens, self.results = max_tokens, None
        self.thread = threading.Thread(target=self._run, args=(target, request_id), daemon=True)
        self.thread.start()

    def _run(self, target, request_id):
        self.results = grpc_stream(target, "ensemble", ensemble_tensors("Count to one hundred:", self.max_tokens),
                                   request_id)

    def check_whole(self) -> None:
        self.thread.join(180)
        check(self.results is not None, "the other client's request never ended")
        _, tokens, reason = text_of(self.results)
        check(tokens == self.max_tokens and reason == "length",
              f"the other client's request ended after {tokens} of {self.max_tokens} tokens ({reason or 'no reason'})")


def engine_idle(target: Target, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"http://{target.metrics}/metrics", timeout=10) as r:
            text = r.read().decode()
        values = {m.group(1): float(m.group(2)) for m in
                  re.finditer(r'^(tritone_(?:num_requests_running|num_requests_waiting|kv_blocks_used))\{[^}]*\} (\S+)$',
                              text, re.M)}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.25)


# ---- the cases: each returns a short account, or raises Failed

CASES: list[tuple[str, str, Callable[[Target], str]]] = []


def case(group: str):
    def register(fn):
        CASES.append((group, fn.__name__, fn))
        return fn
    return register


def _abort_is_refused_and_the_victim_runs_on(t: Target, request_id: str, key: bytes | None) -> None:
    """Another client's stream with `request_id`, and an abort of that id sent straight to llm."""
    victim = Victim(t, request_id)
    time.sleep(0.5)
    tensors = [("ABORT_REQUEST_ID", np.array([[request_id.encode()]], dtype=object), "BYTES")]
    if key is not None:
        tensors.append(("CONTROL_KEY", np.array([[key]], dtype=object), "BYTES"))
    error = first_error(grpc_stream(t, "llm", tensors, empty_final=True))
    check(error is not None and "control_key" in error, f"the abort was not refused: {error}")
    victim.check_whole()


@case("triton")
def abort_by_request_id_without_the_key_ends_no_one(t: Target) -> str:
    _abort_is_refused_and_the_victim_runs_on(t, "1", None)
    return "refused, naming control_key; the stream with request id '1' ran to its end"


@case("triton")
def abort_with_a_forged_key_ends_no_one(t: Target) -> str:
    _abort_is_refused_and_the_victim_runs_on(t, "victim-2", FORGED_KEY)
    return "refused; the stream ran to its end"


@case("triton")
def abort_by_engine_key_is_gone(t: Target) -> str:
    results = grpc_stream(t, "llm", [("ABORT_KEY", np.array([[0]], dtype=np.uint64), "UINT64")], empty_final=True)
    error = first_error(results)
    check(error is not None, "an ABORT_KEY request was accepted")
    return f"refused: {error[:80]}"


@case("triton")
def a_direct_llm_response_reveals_no_key(t: Target) -> str:
    results = grpc_stream(t, "llm", llm_tensors(3))
    check(first_error(results) is None, f"a plain direct request failed: {first_error(results)}")
    keys = {int(r.as_numpy("STATE").reshape(-1)[6]) for r, _ in results if r.as_numpy("STATE") is not None}
    check(keys == {0}, f"STATE carries request keys {keys}")
    return "request_key 0 in every STATE"


@case("triton")
def flow_control_with_a_forged_key_is_refused(t: Target) -> str:
    results = grpc_stream(t, "llm", llm_tensors(3, CONTROL_KEY=(np.array([[FORGED_KEY]], dtype=object), "BYTES")))
    error = first_error(results)
    check(error is not None and "control_key" in error, f"not refused: {error}")
    return "refused, naming control_key"


@case("triton")
def llm_refuses_bad_words_past_the_ensembles_limit(t: Target) -> str:
    n = 100_000
    words = np.stack([np.arange(n, dtype=np.int32) % 1000, np.arange(1, n + 1, dtype=np.int32)])[None]
    results = grpc_stream(t, "llm", llm_tensors(2, BAD_WORDS_IDS=(words, "INT32")))
    error = first_error(results)
    check(error is not None and "bad_words_ids" in error, f"not refused: {error}")
    return "100,000 sequences refused, naming bad_words_ids"


@case("triton")
def llm_refuses_stop_words_past_the_limit(t: Target) -> str:
    words = np.array([[f"w{i}".encode() for i in range(1000)]], dtype=object)
    error = first_error(grpc_stream(t, "llm", llm_tensors(2, STOP_WORDS=(words, "BYTES"))))
    check(error is not None and "stop_words" in error, f"not refused: {error}")
    return "1,000 stop words refused, naming stop_words"


@case("triton")
def llm_refuses_ids_outside_the_vocabulary(t: Target) -> str:
    tensors = [("INPUT_IDS", np.array([[1, 2**31 - 1]], dtype=np.int32), "INT32"),
               ("MAX_TOKENS", np.array([[2]], dtype=np.int32), "INT32")]
    error = first_error(grpc_stream(t, "llm", tensors))
    check(error is not None and "input_ids" in error, f"not refused: {error}")
    return "refused, naming input_ids"


@case("triton")
def forged_postprocessing_states_beside_a_live_stream(t: Target) -> str:
    """A made-up STATE claiming a huge send number would, if believed, make every stream's chunk
    in flight look lost, and the llm model would cancel them."""
    import tritonclient.grpc as grpcclient

    from tritone_client import infer_inputs

    victim = Victim(t, "victim-3", max_tokens=64)
    client = grpcclient.InferenceServerClient(t.grpc)
    try:
        for i in range(20):
            state = np.array([[0, 1, 0, 4, 1, 0, (i << 16) | i, 1, 2**62]], dtype=np.int64)
            client.infer("postprocessing", infer_inputs(grpcclient, [
                ("TOKEN_IDS", np.array([[5]], dtype=np.int32), "INT32"), ("STATE", state, "INT64")]))
            time.sleep(0.05)
    finally:
        client.close()
    victim.check_whole()
    return "20 forged STATEs; the stream beside them ran to its end"


@case("triton")
def a_malformed_postprocessing_request_fails_alone(t: Target) -> str:
    import tritonclient.grpc as grpcclient

    from tritone_client import infer_inputs

    client = grpcclient.InferenceServerClient(t.grpc)
    errors = []
    try:
        for state in ([[1]], [[0, 1, 0, 4, 1, 99, 0, 1, 1]]):
            try:
                client.infer("postprocessing", infer_inputs(grpcclient, [
                    ("TOKEN_IDS", np.array([[5]], dtype=np.int32), "INT32"),
                    ("STATE", np.array(state, dtype=np.int64), "INT64")]))
            except Exception as exc:
                errors.append(str(exc))
    finally:
        client.close()
    check(len(errors) == 2 and all("state" in e for e in errors), f"errors: {errors}")
    status, body = generate(t, {"text_input": "Hi", "max_tokens": 2})
    check(status == 200, f"the server stopped serving: {status} {body}")
    return "each refused, naming state; the server serves"


def _batch_with(t: Target, bad: dict, n_good: int = 6) -> tuple[list, tuple]:
    """A bad request among good ones sent at once, so that the dynamic batcher puts them together."""
    out, threads = [None] * n_good, []

    def good(i):
        out[i] = generate(t, {"text_input": f"Say {i}", "max_tokens": 2})

    for i in range(n_good):
        threads.append(threading.Thread(target=good, args=(i,)))
    for thread in threads:
        thread.start()
    bad_result = generate(t, bad)
    for thread in threads:
        thread.join(120)
    return out, bad_result


@case("triton")
def a_lone_surrogate_in_messages_fails_alone(t: Target) -> str:
    messages = '[{"role": "user", "content": "\\ud800"}]'
    goods, (status, body) = _batch_with(t, {"messages": messages, "max_tokens": 2})
    check(status == 400 and "messages[0].content" in str(body), f"{status} {body}")
    check(all(s == 200 for s, _ in goods), f"a neighbour failed: {goods}")
    return "400 naming messages[0].content; 6 neighbours served"


@case("triton")
def tool_calls_that_are_not_objects_fail_alone(t: Target) -> str:
    messages = json.dumps([{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": None, "tool_calls": ["x", 5]},
                           {"role": "user", "content": "again"}])
    goods, (status, body) = _batch_with(t, {"messages": messages, "max_tokens": 2})
    check(status == 400 and "tool_calls[0]" in str(body), f"{status} {body}")
    check(all(s == 200 for s, _ in goods), f"a neighbour failed: {goods}")
    return "400 naming messages[1].tool_calls[0]; 6 neighbours served"


@case("triton")
def integers_out_of_range_are_refused(t: Target) -> str:
    # Past 32 bits the generate endpoint's own JSON conversion decides (Triton 2.51 wraps
    # 2**32 + 1 to 1, and answers 2**64 with a 500 of its parser): docs/operations.md.
    for value in (-1, 2**31):
        status, body = generate(t, {"text_input": "Hi", "max_tokens": value})
        check(status == 400 and "max_tokens" in str(body), f"max_tokens {value}: {status} {body}")
    return "max_tokens -1 and 2**31 refused, naming max_tokens"


@case("triton")
def nan_temperature_is_refused(t: Target) -> str:
    tensors = ensemble_tensors("Hi", 2, stream=False) + [("temperature", np.array([[np.nan]], dtype=np.float32), "FP32")]
    error = first_error(grpc_stream(t, "ensemble", tensors))
    check(error is not None and "temperature" in error, f"not refused: {error}")
    return "refused, naming temperature"


@case("triton")
def administrative_apis_need_the_admin_key(t: Target) -> str:
    answers = {}
    for method, path in (("POST", "/v2/repository/index"), ("GET", "/v2/logging"), ("GET", "/v2/trace/setting"),
                         ("GET", "/v2/models/stats"), ("GET", "/v2/systemsharedmemory/status"),
                         ("POST", "/v2/systemsharedmemory/region/board/register")):
        body = {"key": "/tritone-flow-1", "offset": 0, "byte_size": 8} if "register" in path else None
        answers[path] = http_json(t, method, path, body)[0]
    check(all(status == 403 for status in answers.values()), f"answers: {answers}")
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(t.grpc)
    try:
        client.get_log_settings()
        raise Failed("gRPC log settings answered without the key")
    except grpcclient.InferenceServerException:
        pass
    finally:
        client.close()
    return "HTTP 403 on 6 paths; gRPC refused"


@case("triton")
def the_server_still_serves_and_holds_nothing(t: Target) -> str:
    status, body = generate(t, {"text_input": "What is the capital of France?", "max_tokens": 8})
    check(status == 200 and body.get("text_output"), f"{status} {body}")
    values = engine_idle(t)
    check(not any(values.values()), f"left behind: {values}")
    return "serves; no request running or waiting, no KV block used"


# ---- tritone-openai

def openai_post(t: Target, path: str, body, key: str | None = "", timeout: float = 60.0):
    headers = {}
    key = t.api_key if key == "" else key
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return http_json(t, "POST", path, body, headers, base=t.openai, timeout=timeout)


def _openai_400(t: Target, path: str, body: dict, field: str) -> None:
    status, answer = openai_post(t, path, body)
    error = answer.get("error", {}) if isinstance(answer, dict) else {}
    check(status == 400 and field in f"{error.get('param')} {error.get('message')}",
          f"{json.dumps(body)[:120]}: {status} {answer}")


@case("openai")
def openai_integers_out_of_range(t: Target) -> str:
    for value in (4294967297, 2**64, -5):
        _openai_400(t, "/v1/completions", {"model": t.model, "prompt": "Hi", "max_tokens": value}, "max_tokens")
    _openai_400(t, "/v1/completions", {"model": t.model, "prompt": "Hi", "seed": 2**64}, "seed")
    return "max_tokens 2**32+1, 2**64, -5 and seed 2**64: 400 naming the field"


@case("openai")
def openai_malformed_chat_fields(t: Target) -> str:
    base = {"model": t.model, "max_tokens": 2}
    _openai_400(t, "/v1/chat/completions", {**base, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": 5}]}, "tool_calls")
    _openai_400(t, "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "hi"}],
                                            "tools": [{"type": "function", "function": {"name": "f"}}],
                                            "tool_choice": {"type": "function", "function": "f"}}, "tool_choice")
    _openai_400(t, "/v1/chat/completions", {**base, "messages": [{"role": "user", "content": "\ud800"}]}, "messages")
    _openai_400(t, "/v1/chat/completions", {**base, "messages": ["hi"]}, "messages")
    return "tool_calls 5, a string tool_choice.function, a lone surrogate, a message not an object: 400"


@case("openai")
def openai_checks_the_key_before_reading_the_body(t: Target) -> str:
    if not t.api_key:
        raise Failed("the server has no API key: start it with --api-key")
    host, port = t.openai.removeprefix("http://").split(":")
    answers = {}
    for name, key in (("wrong key", "wrong"), ("right key", t.api_key)):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {256 << 20}\r\n\r\n".encode())
            # A first part of the body; the answer must not wait for the rest. (Sent whole, a
            # megabyte can meet the server's close: a reset then loses the answer on the way.)
            try:
                s.sendall(b"x" * (64 << 10))
            except OSError:
                pass
            started = time.monotonic()
            s.settimeout(3)
            try:
                head = s.recv(200).decode(errors="replace")
            except socket.timeout:
                head = "(no answer in 3 s)"
            answers[name] = (head.split("\r\n")[0], time.monotonic() - started)
    check(" 401 " in answers["wrong key"][0] and " 413 " in answers["right key"][0], f"answers: {answers}")
    return f"declared 256 MiB: wrong key {answers['wrong key'][0]!r}, right key {answers['right key'][0]!r}"


@case("openai")
def openai_docs_pages_are_off(t: Target) -> str:
    codes = {}
    for path in ("/docs", "/redoc", "/openapi.json"):
        request = urllib.request.Request(t.openai + path, headers={"Authorization": f"Bearer {t.api_key}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                codes[path] = r.status
        except urllib.error.HTTPError as e:
            codes[path] = e.code
    check(all(code == 404 for code in codes.values()), f"{codes}")
    return "404 for /docs, /redoc, /openapi.json"


@case("openai")
def openai_serves_after_all_this(t: Target) -> str:
    status, body = openai_post(t, "/v1/completions", {"model": t.model, "prompt": "The capital of France is",
                                                      "max_tokens": 4, "temperature": 0})
    check(status == 200 and body["choices"][0]["text"], f"{status} {body}")
    return "serves"


def run(target: Target, groups: tuple[str, ...] = ("triton", "openai"), out=None) -> tuple[int, list[str]]:
    """Runs the cases of `groups`; (number passed, names of those that failed)."""
    out = out or sys.stdout
    passed, failed = 0, []
    for group, name, fn in CASES:
        if group not in groups:
            continue
        try:
            account = fn(target)
            passed += 1
            print(f"PASS  {name}: {account}", file=out, flush=True)
        except Exception as exc:
            failed.append(name)
            print(f"FAIL  {name}: {type(exc).__name__}: {exc}", file=out, flush=True)
    print(f"{passed} passed, {len(failed)} failed", file=out, flush=True)
    return passed, failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/attack", description=__doc__.split("\n\n")[0])
    p.add_argument("--http", help="tritonserver's HTTP host:port (default: start a server)")
    p.add_argument("--grpc", help="tritonserver's gRPC host:port")
    p.add_argument("--metrics", help="tritonserver's metrics host:port")
    p.add_argument("--openai", help="tritone-openai's URL, e.g. http://127.0.0.1:9000 (default: skip its cases)")
    p.add_argument("--api-key", help="tritone-openai's API key")
    p.add_argument("--model", default="", help="the model name tritone-openai serves")
    args = p.parse_args(argv)
    if args.http:
        target = Target(args.http, args.grpc, args.metrics, args.openai, args.api_key, args.model)
        return 1 if run(target, ("triton", "openai") if args.openai else ("triton",))[1] else 0
    from tritone.launcher import free_port, temporary_server

    port, key = free_port(), "attack-key"
    log = pathlib.Path("/tmp/tritone-attack-server.log")
    # The ensemble's pipeline, whose internal models (the cases' targets) are public; inline, there
    # are none, and its one model takes the ensemble's inputs.
    with temporary_server(log, "--openai-port", str(port), "--api-key", key, "--pipeline", "ensemble") as server:
        a = server.args
        target = Target(f"{a.host}:{a.http_port}", f"{a.host}:{a.grpc_port}", f"{a.host}:{a.metrics_port}",
                        server.openai_url.removesuffix("/v1"), key, server.model_dir.name)
        return 1 if run(target)[1] else 0


if __name__ == "__main__":
    sys.exit(main())
