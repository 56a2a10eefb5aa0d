"""Run vLLM on a tiny random-weight Llama on the CPU, with or without kvcore-vllm: for tests and benchmarks.

``python -m kvcore_vllm.runs JOB.json`` runs the engines of one job in this new
process, one after another, and prints one JSON line (``RESULT {...}``): per
engine the greedy tokens of each prompt, the cached-token count vLLM reports
for each request, vLLM's external prefix-cache hit counter, time to first token
and the manager's and store's counters.  A job is::

    {"model": DIR, "engines": [{"kvcore": {"store": URL, ...} or null, "prompts": [[ids...], ...],
                                "max_tokens": 8, "sequential": true, "multiprocess": false, "model": DIR}]}

``kvcore`` is the spec's ``kv_connector_extra_config`` (without ``spec_name``);
null means no connector at all (the reference).  ``multiprocess`` and ``model``
(optional) override the process's engine mode and the job's model for one engine.  An engine runs
in-process unless ``VLLM_ENABLE_V1_MULTIPROCESSING`` is unset or 1 (vLLM's
default: the engine core in its own process).  The model is built by
:func:`tiny_llama` with transformers (``save_pretrained``); nothing is downloaded.
"""

from __future__ import annotations

import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["BLOCK", "engine_env", "kv_transfer_config", "overwrite_file_store", "run_engine", "run_in_new_process",
           "shared_prefix_prompts", "shutdown", "tiny_llama"]

#: vLLM's CPU attention backend needs a block size that is a multiple of 32.
BLOCK = 32


def engine_env(multiprocess: bool = False) -> dict[str, str]:
    """The environment an engine of these runs needs (CPU KV space, in-process unless asked)."""
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if multiprocess else "0",
           "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"), "TOKENIZERS_PARALLELISM": "false"}
    return env


def tiny_llama(path: str | os.PathLike[str], seed: int = 0, layers: int = 2, hidden: int = 128, heads: int = 2,
               kv_heads: int = 1, vocab: int = 512, max_len: int = 2048) -> Path:
    """A random-weight Llama saved with ``save_pretrained`` (float32); two seeds are two different models."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found,unused-ignore]

    out = Path(path)
    if (out / "config.json").exists():
        return out
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_len,
                      torch_dtype="float32", tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    # Random init is near zero everywhere; larger weights make greedy tokens depend on every K/V byte.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() > 1 else 0.1)
    model.save_pretrained(out, safe_serialization=True)
    return out


def kv_transfer_config(kvcore: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` selecting kvcore-vllm with ``kvcore`` as its extra config."""
    extra = {"spec_name": "KvcoreOffloadingSpec", **kvcore}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def _external_hits(llm: Any) -> int | None:
    try:
        for m in llm.get_metrics():
            if m.name == "vllm:external_prefix_cache_hits":
                return int(m.value)
    except Exception:  # metrics off or renamed: the per-request cached counts still tell
        return None
    return None


def _manager_and_worker(llm: Any) -> tuple[Any, Any]:
    """The kvcore manager and worker of an in-process engine (None, None when not reachable)."""
    try:
        core = llm.llm_engine.engine_core.engine_core
        conn = core.scheduler.connector
        manager = conn.connector_scheduler.manager
    except AttributeError:
        return None, None
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group  # type: ignore[import-not-found,unused-ignore]

    worker = None
    if has_kv_transfer_group():
        cw = getattr(get_kv_transfer_group(), "connector_worker", None)
        worker = getattr(cw, "worker", None)
    return manager, worker


def run_engine(model: str, kvcore: dict[str, Any] | None, prompts: list[list[int]], max_tokens: int = 8,
               sequential: bool = True) -> dict[str, Any]:
    """One engine: the prompts (one at a time when ``sequential``), then shut down completely."""
    from vllm import LLM, SamplingParams  # type: ignore[import-not-found,unused-ignore]
    from vllm.inputs import TokensPrompt  # type: ignore[import-not-found,unused-ignore]

    kwargs: dict[str, Any] = dict(
        model=model, skip_tokenizer_init=True, dtype="float32", block_size=BLOCK, enforce_eager=True,
        enable_prefix_caching=True, max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=2048,
        disable_log_stats=False, seed=0,
    )
    if kvcore is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config(kvcore)
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    startup_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    tokens: list[list[int]] = []
    cached: list[int] = []
    ttft: list[float] = []
    t1 = time.perf_counter()
    batches = [[p] for p in prompts] if sequential else [prompts]
    for batch in batches:
        tb = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
        for o in outs:
            tokens.append(list(o.outputs[0].token_ids))
            cached.append(int(o.num_cached_tokens or 0))
            m = getattr(o, "metrics", None)
            first = getattr(m, "first_token_latency", None) if m is not None else None
            ttft.append(float(first) if first else time.perf_counter() - tb)
    gen_s = time.perf_counter() - t1
    result: dict[str, Any] = {"tokens": tokens, "cached": cached, "external_hits": _external_hits(llm),
                              "ttft_s": ttft, "startup_s": startup_s, "generate_s": gen_s}
    manager, worker = _manager_and_worker(llm)
    if worker is not None and hasattr(worker, "flush"):
        worker.flush()
        result["worker"] = {"bytes_loaded": worker.bytes_loaded, "bytes_stored": worker.bytes_stored,
                            "load_s": worker.load_s, "store_s": worker.store_s}
    if manager is not None and hasattr(manager, "stats"):
        result["manager"] = manager.stats()
        from kvcore import InvariantChecker

        InvariantChecker(manager.books).check()  # type: ignore[arg-type,unused-ignore]
        result["invariants"] = "ok"
    shutdown(llm)
    return result


def shutdown(llm: Any) -> None:
    """Shut an engine and vLLM's connector agent (which outlives ``del llm``) down."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown  # type: ignore[import-not-found,unused-ignore]
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # type: ignore[import-not-found,unused-ignore]

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # an engine that is already down
        print(f"engine shutdown: {exc}", file=sys.stderr)
    ensure_kv_transfer_shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def shared_prefix_prompts(seed: int = 0, n: int = 2, shared_blocks: int = 3, tail: int = 20,
                          vocab: int = 500) -> list[list[int]]:
    """``n`` prompts that share ``shared_blocks`` whole blocks, then a tail of each one's own (not block aligned)."""
    r = random.Random(seed)
    shared = [r.randrange(1, vocab) for _ in range(shared_blocks * BLOCK)]
    return [shared + [r.randrange(1, vocab) for _ in range(tail + 7 * i)] for i in range(n)]


def run_in_new_process(model: str, engines: list[dict[str, Any]], workdir: Path,
                       multiprocess: bool = False, timeout: float = 600) -> list[dict[str, Any]]:
    """``engines`` run by ``python -m kvcore_vllm.runs`` in a new process (vLLM's default multi-process
    engine core when ``multiprocess``); their results.  A failed process raises with its stderr."""
    workdir.mkdir(parents=True, exist_ok=True)
    job = workdir / f"job-{time.monotonic_ns()}.json"
    job.write_text(json.dumps({"model": model, "engines": engines}))
    env = {**os.environ, **engine_env(multiprocess=multiprocess)}
    proc = subprocess.run([sys.executable, "-m", "kvcore_vllm.runs", str(job)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine process failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    result: list[dict[str, Any]] = json.loads(lines[-1][len("RESULT "):])
    return result


def overwrite_file_store(root: Path, seed: int = 1) -> int:
    """Every value under a ``file://`` store's directory replaced by garbage of the same length."""
    r = random.Random(seed)
    n = 0
    for f in Path(root).rglob("*"):
        if f.is_file():
            f.write_bytes(r.randbytes(f.stat().st_size))
            n += 1
    return n


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    job = json.loads(Path(argv[0]).read_text())
    out = []
    for eng in job["engines"]:
        if "multiprocess" in eng:
            # Per engine: vLLM reads it when an engine starts (its env cache is dropped between engines).
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if eng["multiprocess"] else "0"
            from vllm import envs  # type: ignore[import-not-found,unused-ignore]

            getattr(envs, "disable_envs_cache", lambda: None)()
        out.append(run_engine(eng.get("model", job["model"]), eng.get("kvcore"), eng["prompts"],
                              eng.get("max_tokens", 8), eng.get("sequential", True)))
    print("RESULT " + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
