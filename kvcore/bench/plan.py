"""What a ``kvcore bench`` run will do, worked out and checked before anything runs.

:func:`plan_bench` turns checked :class:`~kvcore.bench.options.BenchOptions` into the
backends to run (a lone backend's reference appended, a comparison's reference first),
the workload (built), the loop's configuration, each backend's ``--backend-opt``
options, and the notes for stderr.  Every backend's options are validated by its own
config model here, so a bad option stops the command before the first run.

One rule for options that map onto a backend's config field (``--eviction-policy``,
``--window``, ``--swa-size``, ``--pre-alloc-size``, ``--backend-opt``): the value
reaches every backend of the run whose config takes the field, a backend that does not
take it is named in a note, and an option that no backend takes is an error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from kvcore.backend_options import OptionError, format_validation_error, parse_backend_opts
from kvcore.bench.loop import BenchConfig, cache_options
from kvcore.bench.options import DEFAULT_SIZE, MAX_SLOTS, BenchOptions
from kvcore.bench.spec import Workload
from kvcore.config import did_you_mean

__all__ = ["BenchPlan", "plan_bench", "BENCH_MANAGED"]

# Config fields the bench sets from its own options: --backend-opt names the option instead.
BENCH_MANAGED = {
    "size": "--size", "page_size": "--page-size", "max_num_reqs": "--max-num-reqs", "max_context_len": None,
    "device": "--device", "sliding_window_size": "--window", "swa_size": "--swa-size",
    "eviction_policy": "--eviction-policy", "pre_alloc_size": "--pre-alloc-size", "kv_buffer": "--write-kv",
}


@dataclass
class BenchPlan:
    names: list[str]  # the backends asked for; in a comparison with --reference, the reference first
    run_names: list[str]  # what runs: names, plus a lone backend's reference
    with_reference: bool  # run_names[-1] is a lone backend's reference
    workload: Workload
    config: dict[str, Any]  # BenchConfig fields shared by every run
    backend_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per backend, from --backend-opt
    notes: list[str] = field(default_factory=list)

    def bench_config(self, name: str) -> BenchConfig:
        return BenchConfig(backend=name, backend_options=self.backend_options.get(name, {}), **self.config)


def _backend_list(opts: BenchOptions) -> list[str]:
    names: list[str] = []
    for item in list(opts.backend) + ([opts.compare] if opts.compare else []):
        for name in item.split(","):
            name = name.strip()
            if name in names:
                raise OptionError(f"backend {name!r} is named twice: compare different backends")
            if name:
                names.append(name)
    if not names:
        from kvcore.plugins import available_backends

        known = ", ".join(available_backends())
        raise OptionError(f"no backend given: use --backend NAME or --compare a,b (installed: {known})")
    return names


def _why_missing(name: str) -> str:
    from kvcore.plugins import get_backend

    try:
        get_backend(name)
    except LookupError as exc:
        return str(exc)
    return "unknown"


def _default_page_size(configs: Sequence[type[BaseModel]], device: str) -> int:
    """--page-size when not given: the largest default among the backends' configs and the device's."""
    from kvcore.devices import get_device

    sizes = [int(get_device(device).defaults.get("page_size", 1))]
    for config in configs:
        default = config.model_fields["page_size"].default
        sizes.append(default if isinstance(default, int) and default > 0 else 1)
    return max(sizes)


def _takes(config: type[BaseModel], key: str) -> bool:
    """Whether ``config`` accepts option ``key``: a declared field, or any key for a model that validates
    extra options itself (the unified backend's component options)."""
    return key in config.model_fields or config.model_config.get("extra") == "allow"


def _memory_needed(slots: int, rows: int, width: int) -> int:
    # About 40 bytes of bookkeeping per slot (free ring, per-page counts, ownership, window mapping)
    # and an int32 req_to_token table of rows x width.
    return 40 * slots + 4 * (rows + 1) * width


def _check_memory(what: str, need: int) -> None:
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    if need > have:
        raise OptionError(f"{what} needs about {need / 2**30:,.1f} GiB of bookkeeping; this machine has "
                          f"{have / 2**30:,.1f} GiB")


def plan_bench(opts: BenchOptions) -> BenchPlan:
    """Resolve ``opts`` against the installed backends and devices; raises OptionError (or the backend's
    ConfigError, BackendNotFound, DeviceUnavailable) naming what to change."""
    from kvcore.bench.sizing import DEFAULT_SWA_MODEL, size_pools
    from kvcore.bench.workloads import WORKLOADS, default_workload, make_workload
    from kvcore.devices import check_device
    from kvcore.plugins import available_backends, get_backend

    names = _backend_list(opts)
    specs = {name: get_backend(name) for name in names}  # BackendNotFound names the known ones
    if opts.reference is not None:
        get_backend(opts.reference)
    workload = opts.workload
    if workload is None:
        workload = default_workload([set(spec.config.model_fields) for spec in specs.values()], opts.trace)
    if workload not in WORKLOADS:
        raise OptionError(f"--workload {workload!r}: choose one of: {', '.join(WORKLOADS)}")
    check_device(opts.device)
    if opts.eviction_policy is not None:
        from kvcore.plugins import available_eviction_policies

        known = available_eviction_policies()
        if opts.eviction_policy.lower() not in known:
            raise OptionError(f"--eviction-policy {opts.eviction_policy!r}: choose one of {', '.join(known)}")

    run_names = list(names)
    with_reference = False
    notes: list[str] = []
    if len(names) == 1 and not opts.no_reference:
        # A backend alone runs with its reference: --reference, else what its plugin names, else radix.
        ref = opts.reference or specs[names[0]].reference or "radix"
        with_reference = ref != names[0] and ref in available_backends()
        if with_reference:
            run_names.append(ref)
        elif ref != names[0]:
            notes.append(
                f"the reference backend {ref!r} is not available ({_why_missing(ref)}); running {names[0]} "
                "alone (--no-reference to say so, --reference NAME for another)"
            )
    elif opts.reference is not None:
        # A comparison: the reference goes first, so every ratio is against it.
        names = run_names = [opts.reference, *(n for n in names if n != opts.reference)]
    configs = {name: get_backend(name).config for name in run_names}
    # The page size and the sizing follow the backends asked for (not a reference added to them).
    asked = [spec.config for spec in specs.values()]

    page_size = opts.page_size or _default_page_size(asked, opts.device)
    if opts.chunk_size % page_size:
        raise OptionError(f"--chunk-size {opts.chunk_size} is not a multiple of the page size {page_size} "
                          "(the backends' default; give --page-size)")

    # Pool sizes: --size, or a model's layout and a memory budget (the default for a sliding-window run).
    model = opts.model
    windowed = [n for n, c in configs.items() if "swa_size" in c.model_fields]
    if model is None and any("swa_size" in c.model_fields for c in asked) and opts.size is None \
            and opts.swa_size is None:
        model = DEFAULT_SWA_MODEL
    budget = opts.kv_budget_bytes if opts.model is not None else None
    if model is not None:
        from kvcore.bench.sizing import DEFAULT_KV_BUDGET, get_model

        budget = budget or DEFAULT_KV_BUDGET
        layout = get_model(model)
        sizes = [size_pools(layout, budget, hybrid=n in windowed, page_size=page_size,
                            swa_full_tokens_ratio=opts.swa_full_tokens_ratio) for n in run_names]
        slots = max(s.full for s in sizes) + max((s.swa or s.full for s in sizes), default=0)
        if max(s.full for s in sizes) > MAX_SLOTS:
            raise OptionError(f"--kv-budget gives {max(s.full for s in sizes):,} slots: more than {MAX_SLOTS:,} "
                              "(slot ids are int32)")
    else:
        size = opts.size or DEFAULT_SIZE
        slots = size + (opts.swa_size or size)

    # Sessions: a sparse-decode backend (its config has top_k, the field the sparse-decode workload keys on)
    # stages each request's KV to the host once, so it cannot continue a conversation on a streaming session.
    wl = make_workload(workload, seed=opts.seed, num_requests=opts.num_requests, trace=opts.trace,
                       step_ms=opts.step_ms)
    sessions = opts.sessions
    has_turns = any(r.session_id is not None for r in wl.requests)
    no_sessions = [n for n, c in configs.items() if "top_k" in c.model_fields]
    if has_turns and no_sessions:
        if sessions:
            raise OptionError(
                f"--sessions: backend {', '.join(no_sessions)} cannot continue a conversation on a streaming "
                "session (a sparse-decode backend stages a request's KV once); drop --sessions"
            )
        if sessions is None:
            notes.append(
                f"follow-up turns run without streaming sessions on every backend: {', '.join(no_sessions)} "
                "cannot continue a conversation on one (--no-sessions to say so)"
            )
        sessions = False
    elif sessions is None:
        sessions = True

    config: dict[str, Any] = dict(
        device=opts.device, size=opts.size or DEFAULT_SIZE, page_size=page_size, max_num_reqs=opts.max_num_reqs,
        chunk_size=opts.chunk_size, window=opts.window, swa_size=opts.swa_size, swa_interval=opts.swa_interval,
        sessions=sessions, check_every=opts.check_every, eviction_policy=opts.eviction_policy,
        write_kv=opts.write_kv, topk_locality=opts.topk_locality, model=model, kv_budget=budget,
        swa_full_tokens_ratio=opts.swa_full_tokens_ratio, release_window_lock=opts.release_window_lock,
        retract_mode=opts.retract_mode, pre_alloc_size=opts.pre_alloc_size, transfer_steps=opts.transfer_steps,
        host_size=opts.host_size, store=opts.store, host_write_policy=opts.host_write_policy,
    )
    width = wl.max_total_len
    _check_memory(f"--size {slots:,} slots with {opts.max_num_reqs + opts.pre_alloc_size:,} rows of {width:,} "
                  "tokens", _memory_needed(slots, opts.max_num_reqs + opts.pre_alloc_size, width))

    plan = BenchPlan(names, run_names, with_reference, wl, config, notes=notes)
    _route_options(opts, plan, configs)
    for name in run_names:
        _validate(name, configs[name], plan)
    return plan


def _route_options(opts: BenchOptions, plan: BenchPlan, configs: Mapping[str, type[BaseModel]]) -> None:
    """--backend-opt and the bench options that are a backend field: to every backend that takes them.

    The bench sets a field of BENCH_MANAGED itself for a backend whose config declares it (from
    --size, --window, ...); --backend-opt may give it only to a backend that does not declare it
    (the unified backend's component options, such as the swa component's sliding_window_size).
    """
    given = [(flag, key, val) for flag, key, val in (
        ("--eviction-policy", "eviction_policy", opts.eviction_policy),
        ("--window", "sliding_window_size", opts.window),
        ("--swa-size", "swa_size", opts.swa_size),
        ("--pre-alloc-size", "pre_alloc_size", opts.pre_alloc_size or None),
    ) if val is not None]
    for flag, key, val in given:
        _note_takers(f"{flag} {val}", key, plan, configs, declared=True)
    for target, key, value in parse_backend_opts(opts.backend_opt):
        if target is not None and target not in configs:
            raise OptionError(f"--backend-opt {target}:{key}: {target!r} is not a backend of this run "
                              f"({', '.join(plan.run_names)})")
        names = [target] if target is not None else plan.run_names
        if key in BENCH_MANAGED and any(key in configs[n].model_fields for n in names):
            use = BENCH_MANAGED[key]
            raise OptionError(f"--backend-opt {key}: the bench sets {key} itself" + (f"; use {use}" if use else ""))
        if target is not None:
            if not _takes(configs[target], key):
                raise OptionError(f"--backend-opt {target}:{key}: backend {target!r} takes no option {key!r}"
                                  f"{did_you_mean(key, configs[target].model_fields)} "
                                  f"(its options: {', '.join(configs[target].model_fields)})")
            plan.backend_options.setdefault(target, {})[key] = value
            continue
        for name in _note_takers(f"--backend-opt {key}={value}", key, plan, configs):
            plan.backend_options.setdefault(name, {})[key] = value


def _note_takers(what: str, key: str, plan: BenchPlan, configs: Mapping[str, type[BaseModel]],
                 declared: bool = False) -> list[str]:
    """The backends of the run that take ``key`` (``declared``: as a field of their config, the only way the
    bench passes its own options); names the others in a note, and refuses an option no backend takes."""
    takers = [n for n in plan.run_names
              if (key in configs[n].model_fields if declared else _takes(configs[n], key))]
    others = [n for n in plan.run_names if n not in takers]
    if not takers:
        raise OptionError(f"{what}: no backend of this run ({', '.join(plan.run_names)}) takes option {key!r}"
                          f"{did_you_mean(key, (f for n in plan.run_names for f in configs[n].model_fields))}")
    if others:
        plan.notes.append(f"{what} reaches {', '.join(takers)}; {', '.join(others)} "
                          f"{'takes' if len(others) == 1 else 'take'} no {key} option and "
                          f"{'runs' if len(others) == 1 else 'run'} without it")
    return takers


def _validate(name: str, config: type[BaseModel], plan: BenchPlan) -> None:
    """The backend's own config model on exactly the options its run will pass to create_cache."""
    from kvcore.factory import ConfigError

    cfg = plan.bench_config(name)
    options = cache_options(cfg, plan.workload.max_total_len)
    flags: dict[str, str] = {k: v for k, v in BENCH_MANAGED.items() if v}
    if cfg.model is not None:
        flags.update(size="--model/--kv-budget sizing", swa_size="--model/--kv-budget sizing")
    flags.update({k: f"--backend-opt {k}" for k in cfg.backend_options})
    try:
        config(**options)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, flags, f"backend {name!r}")) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"backend {name!r}: {exc}") from None
