"""Real SGLang engines on a CPU for the engine tests: a tiny model, one workload, two clients.

Imports nothing of SGLang or torch at module level (SGLang's scheduler process may unpickle
:func:`scheduler_failed`, and importing this module must stay cheap there).

- :func:`build_tiny_llama` writes a random-weight Llama with transformers' ``save_pretrained``.
- :func:`cpu_engine_env` is the environment SGLang's CPU engine runs with here.
- :class:`EngineClient` runs ``sglang.Engine`` in the process it is made in (its scheduler and
  detokenizer are SGLang's own subprocesses, logging to a file); :class:`HttpClient` talks to a
  real ``python -m sglang.launch_server`` over loopback HTTP.
- :func:`run_workload` sends the same rounds through either and returns what the engine answered.
- :func:`run_config` runs one configuration: an engine in a child process of its own (this module
  run as a program), a server as a child process, so that SGLang's handling of a failed scheduler
  (it kills its process tree) ends that child, never the test run.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[3]
STAND_INS = HERE / "cpu_stand_ins"

# Small enough that the workload's later rounds evict earlier prefixes; the chunk is shorter
# than every prompt, so every prefill is chunked.
MAX_TOTAL_TOKENS = 384
CHUNKED_PREFILL_SIZE = 32
VOCAB = 1024
# Token ids the prompts use: clear of the model's special ids (0, 1, 2).
FIRST_ID, LAST_ID = 10, VOCAB - 10


def build_tiny_gemma4(path: Path) -> Path:
    """A 4-layer random-weight Gemma 4 text model, two sliding-window (32 tokens) and two full layers.

    SGLang treats ``Gemma4ForCausalLM`` as a hybrid SWA model (its SWA pool, its unified FULL + SWA
    tree). SGLang 0.5.19 reads ``swa_num_key_value_heads`` from the config, which transformers'
    ``Gemma4TextConfig`` does not write: it is added to config.json (one KV head, as every layer has).
    """
    import json

    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, global_head_dim=64, sliding_window=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        max_position_embeddings=1024, hidden_size_per_layer_input=0, vocab_size_per_layer_input=VOCAB,
    )
    torch.manual_seed(1234)
    Gemma4ForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    saved = json.loads((path / "config.json").read_text())
    saved["swa_num_key_value_heads"] = 1
    (path / "config.json").write_text(json.dumps(saved, indent=2))
    return path


def build_tiny_llama(path: Path) -> Path:
    """A 2-layer random-weight Llama (head_dim 64, one KV head) saved with ``save_pretrained``; no tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def served_names(kind: str) -> list[str]:
    """kvcore-sglang's own names that serve ``kind`` (a model kind) on the installed SGLang.

    A contract module's ``SERVED`` (backend -> model kinds), where it has one, narrows the targets'
    declared kinds to what that SGLang version is served.
    """
    from kvcore_sglang.config import TARGETS
    from kvcore_sglang.plugin import contract_module

    served = getattr(contract_module(), "SERVED", None)
    return [t.name for t in TARGETS if kind in (t.serves if served is None else served.get(t.backend, ()))]


def cpu_engine_env() -> dict[str, str]:
    """What SGLang's CPU engine needs here, for this process and its children.

    ``SGLANG_USE_CPU_ENGINE=1``: without it ``--device cpu`` is not SGLang's CPU engine.
    ``TRITON_INTERPRET=1``: SGLang's paged allocator runs Triton kernels, interpreted on a CPU.
    ``PYTHONPATH`` puts the ``sgl_kernel`` stand-in (see ``cpu_stand_ins/sgl_kernel``) first.
    ``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1``: SGLang's idle memory check raises on a leak
    (its default; set so that a changed default cannot hide one).
    ``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK=1``: the idle check also runs the tree's own ``sanity_check``
    where SGLang calls it (hybrid SWA and SSM trees).
    """
    path = [str(STAND_INS), os.environ.get("PYTHONPATH", "")]
    return {
        "SGLANG_USE_CPU_ENGINE": "1",
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join(p for p in path if p),
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
        "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK": "1",
        # One OpenMP thread per process: the scheduler and this process share two cores with others.
        "OMP_NUM_THREADS": "1",
    }


@contextlib.contextmanager
def patched_environ(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass(frozen=True)
class Config:
    """One engine configuration: a ``--radix-cache-backend`` name (None: SGLang's default), a page size."""

    backend: str | None
    page_size: int
    disable_radix_cache: bool = False
    model: str = "llama"
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def label(self) -> str:
        name = self.backend or ("disable-radix-cache" if self.disable_radix_cache else "default")
        return f"{self.model}-{name}-page{self.page_size}"

    def server_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            "device": "cpu", "attention_backend": "torch_native", "skip_tokenizer_init": True,
            "page_size": self.page_size, "max_total_tokens": MAX_TOTAL_TOKENS,
            "chunked_prefill_size": CHUNKED_PREFILL_SIZE, "max_running_requests": 8,
            "random_seed": 0, "log_level": "info", "disable_cuda_graph": True,
        }
        if self.backend is not None:
            args["radix_cache_backend"] = self.backend
        if self.disable_radix_cache:
            args["disable_radix_cache"] = True
        args.update(dict(self.extra))
        return args

    def cli_args(self) -> list[str]:
        out: list[str] = []
        for k, v in self.server_args().items():
            flag = "--" + k.replace("_", "-")
            if v is True:
                out.append(flag)
            elif v is not False and v is not None:
                out += [flag, str(v)]
        return out


@dataclass
class Answer:
    """What the engine answered for one request."""

    output_ids: list[int]
    cached_tokens: int
    finish: str

    def to_json(self) -> dict[str, Any]:
        return {"output_ids": self.output_ids, "cached_tokens": self.cached_tokens, "finish": self.finish}

    @classmethod
    def of(cls, out: dict[str, Any]) -> Answer:
        meta = out["meta_info"]
        reason = meta.get("finish_reason") or {}
        return cls(list(out["output_ids"]), int(meta["cached_tokens"]), str(reason.get("type")))


@contextlib.contextmanager
def _fds_to(path: Path) -> Iterator[None]:
    """fds 1 and 2 into ``path`` while SGLang starts its processes, which keep them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


class EngineClient:
    """``sglang.Engine`` in this process; its scheduler and detokenizer log to ``log_path``.

    On a failure in any of its processes SGLang kills this process's tree (its SIGQUIT handler),
    so :func:`run_config` makes one in a child process of its own.
    """

    def __init__(self, model_path: Path, config: Config, log_path: Path):
        self.log_path = log_path
        with patched_environ(cpu_engine_env()):
            if str(STAND_INS) not in sys.path:
                sys.path.insert(0, str(STAND_INS))
            import sglang

            with _fds_to(log_path):
                self.engine = sglang.Engine(model_path=str(model_path), **config.server_args())

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Answer]:
        outs = self.engine.generate(input_ids=[list(p) for p in prompts], sampling_params=_sampling(max_new_tokens))
        return [Answer.of(o) for o in outs]

    def abort_after_first_chunk(self, prompt: Sequence[int], rid: str, max_new_tokens: int) -> Answer:
        stream = self.engine.generate(
            input_ids=list(prompt), sampling_params=_sampling(max_new_tokens), stream=True, rid=rid
        )
        last = None
        for i, chunk in enumerate(stream):
            if i == 0:
                # SGLang's own abort (what POST /abort_request calls).
                self.engine.tokenizer_manager.abort_request(rid=rid)
            last = chunk
        assert last is not None, f"no answer for the aborted request {rid}"
        return Answer.of(last)

    def close(self) -> None:
        self.engine.shutdown()
        # SGLang registers shutdown at exit too; run again there, it would log into closed streams.
        atexit.unregister(self.engine.shutdown)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HttpClient:
    """A real ``python -m sglang.launch_server`` on a free loopback port, talked to over HTTP."""

    def __init__(self, model_path: Path, config: Config, log_path: Path, startup_timeout: float = 600.0):
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.update(cpu_engine_env())
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
               "--host", "127.0.0.1", "--port", str(self.port), "--skip-server-warmup", *config.cli_args()]
        self._log = open(log_path, "ab")
        # A session of its own: the server and every process it starts are stopped together.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            self._wait_ready(startup_timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"launch_server exited with {self.proc.returncode}: see {self.log_path}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise TimeoutError(f"launch_server not ready after {timeout} s: see {self.log_path}")

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Answer]:
        import requests

        body = {"input_ids": [list(p) for p in prompts], "sampling_params": _sampling(max_new_tokens)}
        r = requests.post(self.url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        return [Answer.of(o) for o in r.json()]

    def abort_after_first_chunk(self, prompt: Sequence[int], rid: str, max_new_tokens: int) -> Answer:
        import requests

        body = {"input_ids": list(prompt), "sampling_params": _sampling(max_new_tokens), "stream": True, "rid": rid}
        last = None
        with requests.post(self.url + "/generate", json=body, stream=True, timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                data = line[len(b"data:"):].strip()
                if data == b"[DONE]":
                    break
                if last is None:
                    requests.post(self.url + "/abort_request", json={"rid": rid}, timeout=60).raise_for_status()
                last = json.loads(data)
        assert last is not None, f"no answer for the aborted request {rid}"
        return Answer.of(last)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        # Whatever of its session is left (the scheduler outlives a killed parent for a moment).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


def _sampling(max_new_tokens: int) -> dict[str, Any]:
    # Greedy, and a fixed length: a random model's EOS would end requests at arbitrary points.
    return {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}


# --- the workload -------------------------------------------------------------------------------


@dataclass
class Result:
    """Everything a configuration answered, round by round, and what its log says."""

    rounds: dict[str, list[Answer]] = field(default_factory=dict)
    log: str = ""

    def cached(self, name: str) -> list[int]:
        return [a.cached_tokens for a in self.rounds[name]]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(FIRST_ID, LAST_ID) for _ in range(n)]


def run_workload(client: EngineClient | HttpClient) -> dict[str, list[Answer]]:
    """Rounds of concurrent requests (one batch each, so SGLang's scheduler sees each round at once).

    Prefix families of 40 tokens, every prompt longer than the 32-token prefill chunk; multi-turn
    continuations (prompt + answer + new turn); the pool (384 tokens) fills so that later rounds
    evict earlier prefixes, and the first family comes back after eviction; two streamed requests
    aborted after their first token; a last round that shares the aborted requests' prompts.
    """
    rng = random.Random(20261203)
    fam = [_ids(rng, 40) for _ in range(5)]
    rounds: dict[str, list[Answer]] = {}

    r1 = [fam[0] + _ids(rng, 8 + i) for i in range(4)]
    rounds["shared-prefix"] = client.generate(r1, 8)
    # Turn two of two conversations: the first turn's prompt and answer, then a new message.
    r2 = [r1[i] + rounds["shared-prefix"][i].output_ids + _ids(rng, 6) for i in (0, 2)]
    rounds["multi-turn"] = client.generate(r2, 8)
    r3 = [r2[0] + rounds["multi-turn"][0].output_ids + _ids(rng, 5)] + [fam[1] + _ids(rng, 12) for _ in range(3)]
    rounds["third-turn"] = client.generate(r3, 8)
    rounds["fill-1"] = client.generate([fam[2] + _ids(rng, 16 + 2 * i) for i in range(4)], 8)
    rounds["fill-2"] = client.generate([fam[3] + _ids(rng, 20) for _ in range(4)], 12)
    # Back to the first family after the pool filled: what is left of it is a shorter match.
    rounds["after-eviction"] = client.generate([fam[0] + _ids(rng, 10) for _ in range(3)] + [r1[1][:44]], 8)
    # More than the pool holds at once: SGLang queues, evicts and may retract.
    rounds["pressure"] = client.generate([fam[i % 4] + _ids(rng, 30) for i in range(6)], 16)
    a1 = fam[4] + _ids(rng, 20)
    rounds["aborted"] = [client.abort_after_first_chunk(a1, "kvcore-abort-a", 200)]
    rounds["aborted"].append(client.abort_after_first_chunk(a1[:48] + _ids(rng, 12), "kvcore-abort-b", 200))
    rounds["after-abort"] = client.generate([a1[:52] + _ids(rng, 4), fam[4] + _ids(rng, 8), a1[:30]], 8)
    return rounds


def run_small_workload(client: EngineClient | HttpClient) -> dict[str, list[Answer]]:
    """Two short rounds for the slow models (interpreted Triton attention): shared prefixes, then turn two.

    The prompts (48 to 70 tokens) are longer than the 32-token window and the 32-token prefill chunk.
    """
    rng = random.Random(20261204)
    prefix = _ids(rng, 40)
    r1 = [prefix + _ids(rng, 8 + 2 * i) for i in range(3)]
    rounds = {"shared-prefix": client.generate(r1, 4)}
    r2 = [r1[i] + rounds["shared-prefix"][i].output_ids + _ids(rng, 6) for i in (0, 2)] + [prefix[:20] + _ids(rng, 30)]
    rounds["multi-turn"] = client.generate(r2, 4)
    return rounds


def read_log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


TREE_CACHE_LINE = re.compile(r"Tree cache initialized: source=(\S+) impl=(\w+)")
# What SGLang's idle check (SchedulerInvariantChecker) and its pool checks log or raise on a leak.
# (Not every traceback: launch_server logs refused connections of its own startup probes.)
LEAK_PATTERNS = (
    "memory leak detected", "double free", "use-after-free", "Received sigquit", "Scheduler hit an exception",
)


def tree_cache_lines(log: str) -> list[tuple[str, str]]:
    return TREE_CACHE_LINE.findall(log)


def leak_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if any(p in line for p in LEAK_PATTERNS)]


ENGINE_TIMEOUT_S = 900.0


def run_config(model_path: Path, config: Config, log_dir: Path, http: bool = False, small: bool = False) -> Result:
    """Start the engine (or server) of ``config``, run the workload (``small``: the short one), stop it.

    An engine runs in a child process (:func:`main`), in a session of its own; an engine that dies
    (SGLang kills its own tree when its scheduler fails) fails the configuration with its log.
    """
    log_path = log_dir / f"{config.label}{'-http' if http else ''}.log"
    if http:
        client = HttpClient(model_path, config, log_path)
        try:
            rounds = (run_small_workload if small else run_workload)(client)
        finally:
            client.close()
        return Result(rounds=rounds, log=read_log(log_path))
    out_path = log_dir / f"{config.label}.json"
    out_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-c", f"from {__name__} import main; main()", str(model_path),
           json.dumps(_config_json(config)), str(log_path), str(out_path), "small" if small else "full"]
    env = dict(os.environ)
    # This module by its package name in the child: the repository root first on its path.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            # The engine's scheduler and detokenizer, whatever became of the child.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log_text = read_log(log_path)
    if rc != 0 or not out_path.exists():
        why = f"ran past {ENGINE_TIMEOUT_S:.0f} s" if rc is None else f"exited with {rc}"
        failures = "\n".join(leak_lines(log_text)[:20]) or "\n".join(log_text.splitlines()[-20:])
        raise RuntimeError(f"engine {config.label} {why}; its log ({log_path}) says:\n{failures}")
    answers = json.loads(out_path.read_text())
    rounds = {name: [Answer(**a) for a in round_answers] for name, round_answers in answers.items()}
    return Result(rounds=rounds, log=log_text)


def _config_json(config: Config) -> dict[str, Any]:
    return {"backend": config.backend, "page_size": config.page_size, "disable_radix_cache": config.disable_radix_cache,
            "model": config.model, "extra": [list(kv) for kv in config.extra]}


def main() -> None:
    """The child of :func:`run_config`.

    argv: the model, the config (JSON), the log, the answers' file, the workload (``small`` or ``full``).
    """
    model_path, config_json, log_path, out_path, workload = sys.argv[1:6]
    raw = json.loads(config_json)
    raw["extra"] = tuple(tuple(kv) for kv in raw["extra"])
    client = EngineClient(Path(model_path), Config(**raw), Path(log_path))
    try:
        rounds = (run_small_workload if workload == "small" else run_workload)(client)
        # Idle: SGLang's scheduler runs its memory check on every idle pass; give it a few.
        time.sleep(1.0)
        client.engine.get_server_info()
    finally:
        client.close()
    Path(out_path).write_text(json.dumps({name: [a.to_json() for a in answers] for name, answers in rounds.items()}))
