"""The options of ``kvcore bench`` as one pydantic model: ranges, choices and the checks between them.

Everything here is checked before a plugin loads or a pool is allocated; what needs the
installed backends (names, their config fields, defaults) is :mod:`kvcore.bench.plan`.
A field's error names the command-line option (``--pre-alloc-size``, not
``pre_alloc_size``): :func:`kvcore.backend_options.format_validation_error` with the
command's flags.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvcore.bench.lifecycle import RETRACT_MODES

__all__ = ["BenchOptions", "MAX_SLOTS", "MAX_ROWS", "MAX_REQUESTS", "MAX_TRANSFER_STEPS", "MAX_PAGE_SIZE",
           "DEFAULT_SIZE", "RETRACT_MODES"]

# Slot ids live in int32 req_to_token rows; more rows than this is no engine's batch.
MAX_SLOTS = 2**31 - 2**16
MAX_ROWS = 2**20
MAX_REQUESTS = 10**7
# A transfer step is a scheduler step; beyond this a pd-decode run waits (idle) for a very long time.
MAX_TRANSFER_STEPS = 10_000
MAX_PAGE_SIZE = 2**16
DEFAULT_SIZE = 65536

_INT64 = 2**63


class BenchOptions(BaseModel):
    """What ``kvcore bench`` was asked for, checked; ``None`` means "the default" where that depends on the run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: list[str] = Field(default_factory=list)
    compare: str | None = None
    device: str = "cpu"
    workload: str | None = None
    trace: str | None = None
    seed: int = 0
    num_requests: int | None = Field(None, ge=1)
    as_json: bool = False
    markdown: bool = False
    plot: str | None = None
    check_every: int = Field(0, ge=0)
    size: int | None = Field(None, ge=1)
    model: str | None = None
    kv_budget: str | None = None
    swa_full_tokens_ratio: float = Field(0.8, allow_inf_nan=False)
    release_window_lock: bool = False
    retract_mode: str = "recompute"
    pre_alloc_size: int = Field(0, ge=0)
    transfer_steps: int = Field(4, ge=0)
    # Tiers (kvcore.bench.tiers): host-tier slots, a KV store URL, engine processes sharing it.
    host_size: int = Field(0, ge=0)
    store: str | None = None
    instances: int = Field(1, ge=1)
    host_write_policy: str = "write_through"
    page_size: int | None = Field(None, ge=1)
    max_num_reqs: int = Field(128, ge=1)
    chunk_size: int = Field(2048, ge=1)
    window: int | None = Field(None, ge=1)
    swa_size: int | None = Field(None, ge=1)
    swa_interval: int = Field(128, ge=1)
    sessions: bool | None = None
    eviction_policy: str | None = None
    step_ms: float = Field(20.0, gt=0, allow_inf_nan=False)
    reference: str | None = None
    no_reference: bool = False
    write_kv: bool | None = None
    show_progress: bool | None = None
    topk_locality: float = Field(0.5, allow_inf_nan=False)
    backend_opt: list[str] = Field(default_factory=list)

    @field_validator("size", "swa_size", "window", "chunk_size", "swa_interval")
    @classmethod
    def _slots(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_SLOTS:
            raise ValueError(f"{value:,} is more than {MAX_SLOTS:,} slots (slot ids are int32)")
        return value

    @field_validator("max_num_reqs", "pre_alloc_size")
    @classmethod
    def _rows(cls, value: int) -> int:
        if value > MAX_ROWS:
            raise ValueError(f"{value:,} is more than {MAX_ROWS:,} req_to_token rows")
        return value

    @field_validator("num_requests")
    @classmethod
    def _requests(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_REQUESTS:
            raise ValueError(f"{value:,} is more than {MAX_REQUESTS:,}: run several seeds instead")
        return value

    @field_validator("transfer_steps")
    @classmethod
    def _transfer(cls, value: int) -> int:
        if value > MAX_TRANSFER_STEPS:
            raise ValueError(f"{value:,} is more than {MAX_TRANSFER_STEPS:,} scheduler steps (a pd-decode run would "
                             "wait that long for every transfer)")
        return value

    @field_validator("page_size")
    @classmethod
    def _page(cls, value: int | None) -> int | None:
        if value is not None and value > MAX_PAGE_SIZE:
            raise ValueError(f"{value:,} is more than {MAX_PAGE_SIZE:,} tokens per page")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int) -> int:
        if not -_INT64 <= value < _INT64:
            raise ValueError("must fit in 64 bits (a torch generator's seed)")
        return value

    @field_validator("swa_full_tokens_ratio")
    @classmethod
    def _ratio(cls, value: float) -> float:
        if not 0 < value <= 1:
            raise ValueError("must lie in (0, 1]: window-pool tokens per full-pool token")
        return value

    @field_validator("topk_locality")
    @classmethod
    def _locality(cls, value: float) -> float:
        if not 0 <= value <= 1:
            raise ValueError("must lie in [0, 1]: the share of a top-k selection that is the most recent tokens")
        return value

    @field_validator("retract_mode")
    @classmethod
    def _retract_mode(cls, value: str) -> str:
        if value not in RETRACT_MODES:
            raise ValueError(f"choose one of {', '.join(RETRACT_MODES)}")
        return value

    @field_validator("model")
    @classmethod
    def _model(cls, value: str | None) -> str | None:
        if value is not None:
            from kvcore.bench.sizing import MODELS

            if value not in MODELS:
                raise ValueError(f"unknown model; choose one of: {', '.join(MODELS)}")
        return value

    @field_validator("kv_budget")
    @classmethod
    def _kv_budget(cls, value: str | None) -> str | None:
        if value is not None:
            from kvcore.bench.sizing import parse_bytes

            parse_bytes(value)  # a ValueError that says what a size looks like
        return value

    @field_validator("plot")
    @classmethod
    def _plot(cls, value: str | None) -> str | None:
        if value is not None:
            check_plot_target(value)
        return value

    @model_validator(mode="after")
    def _together(self) -> BenchOptions:
        if self.model is None and self.kv_budget is not None:
            raise ValueError("--kv-budget sizes pools for a --model: name one (e.g. --model gemma-3-27b)")
        if self.model is not None and (self.size is not None or self.swa_size is not None):
            raise ValueError("--model sizes the pools from --kv-budget: drop --size/--swa-size, or drop --model")
        if self.max_num_reqs + self.pre_alloc_size > MAX_ROWS:
            raise ValueError(
                f"--max-num-reqs {self.max_num_reqs:,} + --pre-alloc-size {self.pre_alloc_size:,} is more than "
                f"{MAX_ROWS:,} req_to_token rows"
            )
        if self.page_size is not None and self.chunk_size % self.page_size:
            raise ValueError(f"--chunk-size {self.chunk_size} is not a multiple of --page-size {self.page_size}")
        if self.as_json and self.markdown:
            raise ValueError("--json and --markdown both choose the output: give one")
        return self

    @property
    def kv_budget_bytes(self) -> int | None:
        """The --model budget in bytes (its default when --model is given alone); None without --model."""
        if self.model is None:
            return None
        from kvcore.bench.sizing import DEFAULT_KV_BUDGET, parse_bytes

        return parse_bytes(self.kv_budget) if self.kv_budget is not None else DEFAULT_KV_BUDGET


def check_plot_target(plot: str) -> None:
    """Refuse a --plot target that cannot be written, before the benchmark runs.

    Writability is tried, not read from the mode bits: ``os.access`` says yes to root on a
    read-only mount, and the run would fail only at the end.
    """
    import importlib.util
    import tempfile
    from pathlib import Path

    if not plot.lower().endswith(".png"):
        raise ValueError(f"writes a PNG: give a file name ending in .png, not {plot!r}")
    target = Path(plot)
    folder = target.parent
    if not folder.is_dir():
        raise ValueError(f"folder {str(folder)!r} does not exist")
    if target.is_dir():
        raise ValueError(f"{plot!r} is a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".kvcore-plot-", suffix=".png"):
            pass
    except OSError as exc:
        raise ValueError(f"folder {str(folder)!r} is not writable ({exc.strerror or exc})") from None
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("needs matplotlib: pip install matplotlib")
