"""Soak: vLLM's OpenAI-compatible server in host mode at vLLM's defaults, under mixed
load, for a bounded time; resident memory and KV-cache use over time, server errors,
and greedy probe answers before and after the load.

The server is started as ``docs/serving.md`` starts it (``tests-integration/servers.py``:
``python -m vllm.entrypoints.openai.api_server`` with ``NPU_BRIDGE_DEVICE=cpu`` on a free
port of 127.0.0.1, its own process group, stopped as one): SmolLM2-135M-Instruct (the
fp32 checkpoint of ``examples/smollm2.py``), ``--max-model-len 2048``, no graph,
compilation or eager flag (torch.compile on, FULL_AND_PIECEWISE graphs, vLLM's default
``max_num_seqs``), and a KV cache of ``--kv-tokens`` tokens
(``--kv-cache-memory-bytes``), smaller than the load needs, so that requests are
preempted.

Host mode captures each graph at the first step that needs it, and each capture costs
the worker resident memory. Before the measurement the script primes every graph the
load can reach (``prime``): one prefill of exactly ``s`` tokens for each capture size
``s`` the server logged (a PIECEWISE step of that size), then ``--clients`` concurrent
decodes that finish one by one (FULL decode steps up to that batch), recording the
worker's anonymous RSS after each. The load, and ``--warmup``, start after it.

``--clients`` threads send requests until ``--duration`` seconds or ``--max-requests``
requests have passed, each drawn at random (``--seed``) from:

* ``stream``: a streamed chat completion (16 to 128 tokens), read to its end;
* ``drop``: a streamed chat completion closed by the client after two chunks;
* ``long``: a completion whose prompt (random token ids) and answer (64 to 256 tokens)
  reach to within 16 tokens of ``max_model_len``;
* ``grow``: a completion of a prompt of a third to a half of ``max_model_len`` (random
  token ids) and 256 to 512 tokens of answer: the cache admits two or three of them,
  and runs out as they grow. After each probe round, the first request of every other
  client is one (they reach an empty cache together, and vLLM must preempt), that of
  the others a ``bad`` one;
* ``chat``: a chat completion, not streamed;
* ``bad``: a prompt longer than ``max_model_len``, a negative ``max_tokens``, malformed
  JSON, an unknown model or a non-numeric temperature: each must get a 4xx answer.

Every answer of the load runs to its ``max_tokens`` (vLLM's ``ignore_eos``): running
requests keep taking pages, and the cache runs out under them (preemption).

Every ``--probe-every`` seconds the clients pause, in-flight requests finish, and
four fixed greedy chat probes are sent one at a time; every probe round must answer
exactly what the first round did (sent after start-up, before any load). A sampler
reads, every ``--sample-every`` seconds, the resident memory of the server's process
tree (API server, engine core and workers; shared pages counted once per process) and
vLLM's ``/metrics`` (``vllm:kv_cache_usage_perc``, running and waiting requests,
``vllm:num_preemptions_total``). Every server process also writes its own figures
(``soak_process_stats/sitecustomize.py``, put first on the server's ``PYTHONPATH``):
anonymous resident bytes, glibc's heap in use and free but kept, glibc's own mappings,
and the blocks Python's allocator has handed out, which tell memory a program holds from
memory the allocator keeps. Loopback only; it stops by itself.

    python benchmarks/soak_server.py --duration 1200

Prints a table (the samples at start, after priming and ``--warmup`` seconds of load,
and at the end; the priming steps; requests by kind and status; probes) and writes
``benchmarks/results/soak_server.json``. Exits 1 on a 5xx answer, a failed connection,
a good request that failed, a bad one that did not get a 4xx, or a changed probe.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import sys
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests-integration"))

KINDS = {"stream": 4, "drop": 2, "long": 2, "grow": 1, "chat": 1, "bad": 2}  # relative weights
PROBES = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give one tip for writing clear code.",
    "List the planets of the solar system in order from the sun.",
)
PROBE_TOKENS = 32
REQUEST_TIMEOUT_S = 600
VOCAB = range(100, 49000)  # SmolLM2's ordinary tokens (49,152 in all)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=1200, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=180, help="seconds of load before 'warm'")
    parser.add_argument("--max-requests", type=int, default=20000)
    parser.add_argument("--clients", type=int, default=8, help="concurrent client threads")
    parser.add_argument("--probe-every", type=float, default=240, help="seconds between probes")
    parser.add_argument("--sample-every", type=float, default=10)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-tokens", type=int, default=2304, help="KV cache size in tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/soak_server.json")
    parser.add_argument("--report", type=Path, help="print this earlier result instead of a run")
    args = parser.parse_args(argv)
    if args.duration <= 0 or args.clients < 1 or args.max_requests < 1:
        parser.error("--duration, --clients and --max-requests must be positive")
    if args.kv_tokens < args.max_model_len:
        parser.error(f"--kv-tokens must hold one request of {args.max_model_len} tokens")
    return args


def kv_bytes_per_token(model: Path) -> int:
    """K and V of every layer for one token, float32 (the server's dtype)."""
    config = json.loads((model / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * heads * head_dim * 4


# --- requests --------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str
    status: int | str  # HTTP status, or "dropped", or the exception's name
    ok: bool  # what the kind expects (2xx; for ``bad`` a 4xx; ``drop`` closed early)
    seconds: float


class Client:
    """HTTP to the server on loopback, one connection per request."""

    def __init__(self, port: int, model: str) -> None:
        self.port, self.model = port, model

    def _send(self, path: str, body: bytes) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT_S)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        return conn.getresponse()

    def post(self, path: str, payload: dict | bytes) -> tuple[int, bytes]:
        body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        reply = self._send(path, body)
        try:
            return reply.status, reply.read()
        finally:
            reply.close()

    def stream(self, payload: dict, chunks: int | None) -> tuple[int | str, int]:
        """POST a streamed request; read ``chunks`` SSE events and close (None: all).
        Returns the status (``"dropped"`` when closed early) and the events read."""
        reply = self._send("/v1/chat/completions", json.dumps(payload).encode())
        events = 0
        try:
            if reply.status != 200:
                reply.read()
                return reply.status, 0
            for line in reply:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    return 200, events
                events += 1
                if chunks is not None and events >= chunks:
                    return "dropped", events
            return "truncated", events  # the server ended the stream without [DONE]
        finally:
            reply.close()  # closes the socket: the server sees the client go

    def chat(self, content: str, max_tokens: int, stream: bool = False) -> dict:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }

    def load_chat(self, content: str, max_tokens: int, stream: bool = False) -> dict:
        """A chat of the load: every one of its ``max_tokens`` generated (vLLM's
        ``ignore_eos``), so that running requests keep taking KV pages."""
        return {**self.chat(content, max_tokens, stream), "ignore_eos": True}


def bad_request(client: Client, rng: random.Random, max_model_len: int) -> tuple[int, bytes]:
    """One of five requests the server must refuse with a 4xx."""
    choice = rng.randrange(5)
    if choice == 0:
        prompt = [rng.choice(VOCAB) for _ in range(max_model_len + 50)]
        body = {"model": client.model, "prompt": prompt, "max_tokens": 8}
        return client.post("/v1/completions", body)
    if choice == 1:
        return client.post("/v1/chat/completions", client.chat("Hello", -1))
    if choice == 2:
        return client.post("/v1/chat/completions", b'{"model": "x", "messages": [{"role":')
    if choice == 3:
        return client.post("/v1/chat/completions", {**client.chat("Hello", 8), "model": "nope"})
    return client.post("/v1/chat/completions", {**client.chat("Hello", 8), "temperature": "hot"})


def one_request(
    client: Client, kind: str, rng: random.Random, max_model_len: int
) -> tuple[int | str, bool]:
    """Send one request of ``kind``; its status and whether it is what the kind expects."""
    question = rng.choice((*PROBES, "Tell me a story about a lighthouse keeper."))
    if kind == "stream":
        status, _ = client.stream(client.load_chat(question, rng.randint(16, 128), True), None)
        return status, status == 200
    if kind == "drop":
        status, _ = client.stream(client.load_chat(question, 256, True), 2)
        return status, status == "dropped"
    if kind == "long":
        max_tokens = rng.randint(64, 256)  # decodes that take new pages: preemption
        length = max_model_len - max_tokens - rng.randint(1, 16)
        prompt = [rng.choice(VOCAB) for _ in range(length)]
        body = {"model": client.model, "prompt": prompt, "max_tokens": max_tokens}
        status, _ = client.post("/v1/completions", {**body, "temperature": 0.0, "ignore_eos": True})
        return status, status == 200
    if kind == "grow":
        prompt_len = rng.randint(max_model_len // 3, max_model_len // 2)
        prompt = [rng.choice(VOCAB) for _ in range(prompt_len)]
        max_tokens = rng.randint(256, 512)  # two of them outgrow a cache that took both
        body = {"model": client.model, "prompt": prompt, "max_tokens": max_tokens}
        status, _ = client.post("/v1/completions", {**body, "temperature": 0.0, "ignore_eos": True})
        return status, status == 200
    if kind == "chat":
        body = client.load_chat(question, rng.randint(8, 64))
        status, _ = client.post("/v1/chat/completions", body)
        return status, status == 200
    status, _ = bad_request(client, rng, max_model_len)
    return status, 400 <= status < 500


# --- priming: every graph the load can reach, before the measurement ------------------


def capture_sizes(log: Path) -> list[int]:
    """The batch sizes vLLM captures graphs for, as the server logged its config."""
    marker = "cudagraph_capture_sizes': ["
    found: list[int] = []
    for after in log.read_text(errors="replace").split(marker)[1:]:
        listed = after.split("]", 1)[0]
        found = [int(x) for x in listed.split(",") if x.strip()] or found
    if not found:
        raise RuntimeError(f"no cudagraph_capture_sizes in {log}")
    return found


def worker_pid(process) -> int:
    """The server process that runs the model: vLLM's worker, else its engine core."""
    labels = tree_labels(process)
    for wanted in ("Worker", "EngineCore"):
        for pid, name in labels.items():
            if wanted in name:
                return pid
    raise RuntimeError(f"no worker among the server's processes {sorted(labels.values())}")


def rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(p[1]) * 1024 for p in map(str.split, status) if p[0] == "RssAnon:")


def prime(client: Client, sizes: list[int], pid: int, counters_dir: Path, clients: int) -> list:
    """Run every graph the load can reach once, so that host mode (graphs captured at
    first use) has captured them before the measurement: one prefill of exactly ``s``
    tokens (a PIECEWISE step of size ``s``) for each capture size ``s`` above 1, then
    ``clients`` concurrent decodes that finish one by one (FULL decode steps of every
    size up to ``clients``). Returns, after each, the worker's anonymous RSS and the
    graphs captured so far."""
    rng = random.Random(1)
    steps = []

    def record(label) -> None:
        steps.append({"size": label, "rss_anon": rss_anon(pid), **graph_counters(counters_dir)})

    record("start")
    for size in (s for s in sizes if s > 1):
        prompt = [rng.choice(VOCAB) for _ in range(size)]
        body = {"model": client.model, "prompt": prompt, "max_tokens": 1, "ignore_eos": True}
        status, reply = client.post("/v1/completions", body)
        if status != 200:
            raise RuntimeError(f"priming prefill of {size} got HTTP {status}: {reply[:300]!r}")
        record(size)

    def decode(i: int) -> None:
        status, reply = client.post("/v1/chat/completions", client.load_chat("Hi", 8 * (i + 1)))
        if status != 200:
            raise RuntimeError(f"priming decode got HTTP {status}: {reply[:300]!r}")

    threads = [threading.Thread(target=decode, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    record(f"decode 1-{clients}")
    return steps


# --- load, probes, samples -------------------------------------------------------------


@dataclass
class Load:
    """Shared state of the client threads."""

    deadline: float
    max_requests: int
    running: threading.Event = field(default_factory=threading.Event)
    idle: threading.Condition = field(default_factory=threading.Condition)
    in_flight: int = 0
    sent: int = 0
    resumed: int = 0  # times the load (re)started: a client's first request after is set
    outcomes: list[Outcome] = field(default_factory=list)

    def done(self) -> bool:
        return time.monotonic() >= self.deadline or self.sent >= self.max_requests

    def take_turn(self) -> bool:
        """Wait while paused; count one request in flight. False when the load is over."""
        while not self.done():
            if not self.running.wait(timeout=1.0):
                continue
            with self.idle:
                if not self.running.is_set() or self.done():
                    continue
                self.in_flight += 1
                self.sent += 1
                return True
        return False

    def finish(self, outcome: Outcome) -> None:
        with self.idle:
            self.outcomes.append(outcome)
            self.in_flight -= 1
            self.idle.notify_all()

    def pause(self) -> None:
        """Stop handing out turns and wait for the requests in flight."""
        self.running.clear()
        with self.idle:
            self.idle.wait_for(lambda: self.in_flight == 0)


def client_loop(load: Load, client: Client, seed: int, max_model_len: int) -> None:
    rng = random.Random(seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    seen = 0
    while load.take_turn():
        kind = rng.choices(kinds, weights)[0]
        if load.resumed != seen:  # half the clients at once on an empty cache
            seen, kind = load.resumed, ("grow", "bad")[seed % 2]
        start = time.monotonic()
        try:
            status, ok = one_request(client, kind, rng, max_model_len)
        except Exception as error:  # a failed connection, a reply that is not HTTP
            status, ok = type(error).__name__, False
        load.finish(Outcome(kind, status, ok, time.monotonic() - start))


def probe(client: Client) -> list[list[int]]:
    """The fixed greedy chat probes, one at a time; their answers' token ids."""
    answers = []
    for question in PROBES:
        body = {**client.chat(question, PROBE_TOKENS), "return_token_ids": True}
        status, reply = client.post("/v1/chat/completions", body)
        if status != 200:
            raise RuntimeError(f"probe {question!r} got HTTP {status}: {reply[:300]!r}")
        answers.append(json.loads(reply)["choices"][0]["token_ids"])
    return answers


def server_process():
    """The server started by ``serve`` (this process's one child) as a psutil Process."""
    import psutil

    children = [
        p
        for p in psutil.Process().children()
        if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())
    ]
    if len(children) != 1:
        raise RuntimeError(f"expected one server process, found {len(children)}")
    return children[0]


def tree_labels(process) -> dict[int, str]:
    """``process`` and every process below it: pid -> name (``api_server`` for
    ``process``; vLLM names its engine core and worker processes)."""
    import psutil

    labels = {}
    for p in [process, *process.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            labels[p.pid] = "api_server" if p.pid == process.pid else p.name()
    return labels


def tree_rss(labels: dict[int, str]) -> dict[str, int]:
    """Resident bytes of the processes of ``labels``, by name."""
    import psutil

    by_name: Counter = Counter()
    for pid, name in labels.items():
        with contextlib.suppress(psutil.NoSuchProcess):
            by_name[name] += psutil.Process(pid).memory_info().rss
    return dict(by_name)


def process_stats(directory: Path, labels: dict[int, str]) -> dict[str, dict]:
    """What each live server process (``labels``: pid -> name) last wrote through
    ``soak_process_stats``: its anonymous resident bytes, glibc's heap (in use and free
    but kept), glibc's own mappings, and the blocks Python's allocator has handed out."""
    found: dict[str, dict] = {}
    for path in sorted(directory.glob("*.json")):
        pid = int(path.stem.rsplit("-", 1)[1])
        if pid not in labels:  # a process that has ended (compile helpers, start-up)
            continue
        with contextlib.suppress(OSError, ValueError):  # the process is writing it
            stats = json.loads(path.read_text())
            stats.pop("name")
            found[labels[pid] if labels[pid] not in found else f"{labels[pid]}-{pid}"] = stats
    return found


def graph_counters(directory: Path) -> dict[str, float]:
    """The worker's graph counters (graphs captured, their bytes), as it last wrote them."""
    path = directory / "dp0-rank0.json"
    with contextlib.suppress(OSError, ValueError):  # not written yet, or being replaced
        counters = json.loads(path.read_text())
        return {k: counters[k] for k in ("captured", "replayed_steps", "capture_bytes")}
    return {}


METRICS = {
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_preemptions_total": "preemptions",
}


def read_metrics(port: int) -> dict[str, float]:
    """The ``METRICS`` of vLLM's Prometheus endpoint, summed over their label sets;
    ``RuntimeError`` when one is missing (a renamed metric would read as 0)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    values: Counter = Counter()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in METRICS:
            values[METRICS[name]] += float(line.rsplit(" ", 1)[1])
    missing = set(METRICS.values()) - set(values)
    if missing:
        raise RuntimeError(f"vLLM's /metrics has no {sorted(missing)}")
    return dict(values)


def sample(port: int, process, counters_dir: Path, started: float) -> dict:
    """One sample: time, resident bytes (in all and by process), metrics, graph counters
    and each process's allocator and collector figures."""
    labels = tree_labels(process)
    by_process = tree_rss(labels)
    return {
        "t": round(time.monotonic() - started, 1),
        "rss": sum(by_process.values()),
        "rss_by_process": by_process,
        **read_metrics(port),
        **graph_counters(counters_dir),
        "processes": process_stats(counters_dir / "processes", labels),
    }


def sampler(port, process, counters_dir, started, samples: list, stop: threading.Event, every):
    import psutil

    while True:
        try:
            samples.append(sample(port, process, counters_dir, started))
        except (OSError, psutil.Error) as error:  # the server is gone: the outcomes say so
            samples.append({"t": round(time.monotonic() - started, 1), "error": repr(error)})
        if stop.wait(every):
            return


# --- the run ---------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    from servers import serve
    from smollm2 import smollm2_checkpoint

    from npu_vllm_bridge.graphs.counters import COUNTERS_DIR_ENV

    model = smollm2_checkpoint()
    kv_bytes = args.kv_tokens * kv_bytes_per_token(model)
    server_args = [
        "--dtype", "float32", "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory-bytes", str(kv_bytes), "--seed", str(args.seed),
    ]  # fmt: skip
    log = args.output.with_suffix(".server.log")
    counters_dir = args.output.with_suffix(".counters")
    stats_dir = counters_dir / "processes"
    stats_dir.mkdir(parents=True, exist_ok=True)
    for old in [*stats_dir.glob("*.json"), *counters_dir.glob("*.json")]:
        old.unlink()  # an earlier run's
    hook = str(Path(__file__).resolve().parent / "soak_process_stats")
    env = {
        COUNTERS_DIR_ENV: str(counters_dir),
        "SOAK_PROCESS_STATS_DIR": str(stats_dir),
        "SOAK_PROCESS_STATS_EVERY": str(args.sample_every),
        "PYTHONPATH": os.pathsep.join(filter(None, (hook, os.environ.get("PYTHONPATH")))),
    }
    launched = time.monotonic()
    with serve(model, server_args, log, env) as server:
        start_seconds = time.monotonic() - launched
        port = int(server.url.rsplit(":", 1)[1])
        client, process = Client(port, server.model), server_process()
        samples: list[dict] = []
        stop = threading.Event()
        started = time.monotonic()
        watcher = threading.Thread(
            target=sampler,
            args=(port, process, counters_dir, started, samples, stop, args.sample_every),
        )
        watcher.start()
        try:
            primed = prime(
                client, capture_sizes(log), worker_pid(process), counters_dir, args.clients
            )
            primed_at = round(time.monotonic() - started, 1)
            baseline = probe(client)
            load = Load(deadline=time.monotonic() + args.duration, max_requests=args.max_requests)
            threads = [
                threading.Thread(target=client_loop, args=(load, client, args.seed + i, args.max_model_len))
                for i in range(args.clients)
            ]  # fmt: skip
            for thread in threads:
                thread.start()
            rounds = drive(load, client, baseline, args.probe_every)  # ends with a probe
            for thread in threads:
                thread.join()
        finally:
            stop.set()
            watcher.join()
        samples.append(sample(port, process, counters_dir, started))
    result = summarize(args, start_seconds, kv_bytes, baseline, rounds, load, samples, primed_at)
    return {**result, "primed": primed, "primed_at": primed_at}


def drive(load: Load, client: Client, baseline: list, every: float) -> list[dict]:
    """Run the load in stretches of ``every`` seconds, probing after each; returns the
    probe rounds (time, whether the answers equal ``baseline``)."""
    rounds = []
    started = time.monotonic()
    while not load.done():
        load.resumed += 1
        load.running.set()
        next_probe = time.monotonic() + every
        while time.monotonic() < next_probe and not load.done():
            time.sleep(1.0)
        load.pause()
        answers = probe(client)
        rounds.append({"t": round(time.monotonic() - started, 1), "same": answers == baseline})
        if answers != baseline:
            rounds[-1]["answers"] = answers
    return rounds


def summarize(
    args, start_seconds, kv_bytes, baseline, rounds, load: Load, samples, primed_at
) -> dict:
    outcomes = load.outcomes
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[str(o.status)] += 1
    server_errors = sum(1 for o in outcomes if isinstance(o.status, int) and o.status >= 500)
    failed = [o for o in outcomes if not o.ok]
    good = [s for s in samples if "rss" in s]
    warm = next((s for s in good if s["t"] >= primed_at + args.warmup), good[-1])
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "server_start_seconds": round(start_seconds, 1),
        "kv_cache_bytes": kv_bytes,
        "requests": len(outcomes),
        "by_kind": {kind: dict(c) for kind, c in by_kind.items()},
        "server_errors_5xx": server_errors,
        "not_as_expected": len(failed),
        "not_as_expected_examples": [vars(o) for o in failed[:10]],
        "probe_baseline": baseline,
        "probe_rounds": rounds,
        "probes_unchanged": all(r["same"] for r in rounds),
        "samples": samples,
        "marks": {"start": good[0], "warm": warm, "end": good[-1]},
    }


def report(result: dict) -> None:
    mib = 2**20
    print(
        f"server start {result['server_start_seconds']} s, KV cache {result['kv_cache_bytes'] / mib:.0f} MiB"
    )
    print(
        f"{'mark':6} {'t (s)':>7} {'RSS (MiB)':>10} {'KV use':>7} {'running':>8} {'waiting':>8} {'preempt':>8}"
    )
    for mark, s in result["marks"].items():
        by_process = ", ".join(f"{k} {v / mib:.0f}" for k, v in s.get("rss_by_process", {}).items())
        print(
            f"{mark:6} {s['t']:7.0f} {s['rss'] / mib:10.0f} {s.get('kv_usage', 0):7.2f} "
            f"{s.get('running', 0):8.0f} {s.get('waiting', 0):8.0f} {s.get('preemptions', 0):8.0f}"
            f"  graphs {s.get('captured', '-')} ({s.get('capture_bytes', 0) / mib:.0f} MiB); {by_process}"
        )
    print(
        "by process (MiB): anonymous RSS = glibc heap in use + free but kept + own mappings + other"
    )
    for mark, s in result["marks"].items():
        for name, p in sorted(s.get("processes", {}).items()):
            heap = (
                f"heap used {p['malloc_used'] / mib:.0f} + free {p['malloc_free'] / mib:.0f}"
                f", mmap {p['malloc_mmap'] / mib:.0f}"
                if "malloc_used" in p
                else "no glibc figures"
            )
            print(
                f"  {mark:6} {name:18} anon {p.get('rss_anon', 0) / mib:6.0f}: {heap}"
                f"; {p['py_blocks']} Python blocks"
            )
    warm, end = result["marks"]["warm"], result["marks"]["end"]
    if end["t"] > warm["t"]:
        slope = (end["rss"] - warm["rss"]) / mib / (end["t"] - warm["t"]) * 60
        print(f"RSS after warm-up: {slope:+.1f} MiB per minute")
    peak = max(s["rss"] for s in result["samples"] if "rss" in s)
    kv_peak = max(s.get("kv_usage", 0) for s in result["samples"])
    print(f"peak RSS {peak / mib:.0f} MiB, peak KV use {kv_peak:.2f}")
    print(f"requests {result['requests']}:")
    for kind, statuses in sorted(result["by_kind"].items()):
        print(f"  {kind:7} {dict(sorted(statuses.items()))}")
    print(f"5xx answers {result['server_errors_5xx']}, not as expected {result['not_as_expected']}")
    rounds = result["probe_rounds"]
    print(f"probe rounds {len(rounds)}, all equal to the first: {result['probes_unchanged']}")


def priming(result: dict) -> None:
    """The worker's anonymous RSS and graphs after each priming request."""
    steps = result.get("primed")
    if not steps:
        return
    mib = 2**20
    print(f"priming (done at {result['primed_at']} s): size, graphs, worker anon RSS (MiB, +step)")
    before = steps[0]["rss_anon"]
    for step in steps:
        grown = (step["rss_anon"] - before) / mib
        before = step["rss_anon"]
        print(
            f"  {step['size']!s:>10} {step.get('captured', '-')!s:>5} "
            f"{step['rss_anon'] / mib:7.0f} {grown:+6.0f}"
        )


def timeline(result: dict, every: float = 120) -> None:
    """One sample each ``every`` seconds: the tree's RSS, the worker's anonymous RSS and
    glibc heap (in use / free but kept), Python blocks, KV use, queue and preemptions."""
    mib = 2**20
    print(
        f"{'t (s)':>6} {'RSS':>6} {'worker':>7} {'heap used':>9} {'heap free':>9} "
        f"{'py blocks':>10} {'KV use':>6} {'run':>4} {'wait':>4} {'preempt':>7}  (MiB)"
    )
    next_t = 0.0
    good = [s for s in result["samples"] if "rss" in s]
    for s in good:
        if s["t"] < next_t and s is not good[-1]:
            continue
        next_t = s["t"] + every
        w = next((p for n, p in s.get("processes", {}).items() if "Worker" in n), {})
        print(
            f"{s['t']:6.0f} {s['rss'] / mib:6.0f} {w.get('rss_anon', 0) / mib:7.0f} "
            f"{w.get('malloc_used', 0) / mib:9.0f} {w.get('malloc_free', 0) / mib:9.0f} "
            f"{w.get('py_blocks', 0):10d} {s['kv_usage']:6.2f} {s['running']:4.0f} "
            f"{s['waiting']:4.0f} {s['preemptions']:7.0f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:  # print an earlier run's result again
        result = json.loads(args.report.read_text())
    else:
        result = run(args)
        args.output.write_text(json.dumps(result, indent=1))
    report(result)
    priming(result)
    timeline(result)
    print(f"wrote {args.output}" if not args.report else f"read {args.report}")
    passed = (
        result["server_errors_5xx"] == 0
        and result["not_as_expected"] == 0
        and result["probes_unchanged"]
    )
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
