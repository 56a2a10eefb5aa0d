"""Pool sizes from a memory budget and a model layout, the way SGLang sizes them.

``kvcore bench --model NAME --kv-budget BYTES`` gives every backend the same bytes of
KV memory: a backend that keeps every layer's K and V for every token (``radix``,
``chunk``, ...) gets ``budget // (per-token bytes x all layers)`` slots (SGLang's
``DefaultPoolConfigurator``); a sliding-window backend (its config has ``swa_size``)
is sized by SGLang 0.5.19's ``HybridSWAPoolConfigurator`` rule
(``model_executor/pool_configurator.py``):

    cell = full_per_token x full_layers + swa_full_tokens_ratio x swa_per_token x swa_layers
    full_tokens = page_align(budget // cell)
    swa_tokens  = page_align(int(full_tokens x swa_full_tokens_ratio))

and refused when ``sliding_window_size + page_size >= swa_tokens`` (the pool cannot hold
one request).  ``per_token`` is ``kv_heads x (head_dim + v_head_dim) x dtype bytes`` per
layer.  So at equal memory the comparison shows what a user of a hybrid model would
see: the bytes the window layers do not spend on old tokens become full-pool slots.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["ModelLayout", "MODELS", "DEFAULT_SWA_MODEL", "DEFAULT_KV_BUDGET", "DEFAULT_SWA_FULL_TOKENS_RATIO",
           "PoolSizes", "get_model", "size_pools", "parse_bytes", "models_table"]

# SGLang's default (ServerArgs.swa_full_tokens_ratio); it overrides it only for DeepSeek V4 and Inkling.
DEFAULT_SWA_FULL_TOKENS_RATIO = 0.8


@dataclass(frozen=True)
class ModelLayout:
    """The KV shape of a hybrid model: how many layers of each kind and what one token costs in each."""

    name: str
    full_layers: int
    swa_layers: int
    kv_heads: int
    head_dim: int
    window: int
    dtype_bytes: int = 2  # bf16 / fp16
    source: str = ""

    @property
    def per_token_layer(self) -> int:
        """Bytes of K and V for one token in one layer (SGLang: heads x (head_dim + v_head_dim) x element size)."""
        return self.kv_heads * 2 * self.head_dim * self.dtype_bytes

    def as_dict(self) -> dict:
        return asdict(self)


# Published configs (Hugging Face config.json of each model: num_hidden_layers, layer_types /
# sliding_window_pattern, num_key_value_heads, head_dim, sliding_window).
MODELS: dict[str, ModelLayout] = {
    m.name: m
    for m in (
        ModelLayout("gpt-oss-120b", 18, 18, 8, 64, 128, 2,
                    "openai/gpt-oss-120b: 36 layers alternating sliding (128) / full, 8 KV heads x 64"),
        ModelLayout("gpt-oss-20b", 12, 12, 8, 64, 128, 2,
                    "openai/gpt-oss-20b: 24 layers alternating sliding (128) / full, 8 KV heads x 64"),
        ModelLayout("gemma-3-27b", 10, 52, 16, 128, 1024, 2,
                    "google/gemma-3-27b-it: 62 layers, every 6th global, sliding window 1024, 16 KV heads x 128"),
        ModelLayout("gemma-3-12b", 8, 40, 8, 256, 1024, 2,
                    "google/gemma-3-12b-it: 48 layers, every 6th global, sliding window 1024, 8 KV heads x 256"),
    )
}
# The default of a run with a sliding-window backend: about 58K full-attention tokens, so the long-decode
# workload presses on memory and the window layers' savings show as running requests and retractions.
DEFAULT_SWA_MODEL = "gpt-oss-120b"
DEFAULT_KV_BUDGET = 4 << 30


@dataclass(frozen=True)
class PoolSizes:
    full: int
    swa: int | None  # None: the backend keeps no separate window pool
    cell_bytes: float  # budget bytes per full-pool token


def get_model(name: str) -> ModelLayout:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}") from None


def size_pools(model: ModelLayout, budget: int, *, hybrid: bool, page_size: int = 1,
               swa_full_tokens_ratio: float = DEFAULT_SWA_FULL_TOKENS_RATIO) -> PoolSizes:
    """The pool sizes ``budget`` bytes buy for ``model``: SGLang's rule for a hybrid SWA pool, else all layers full."""
    if budget <= 0:
        raise ValueError(f"--kv-budget must be positive, got {budget}")
    if not 0 < swa_full_tokens_ratio <= 1:
        raise ValueError(f"--swa-full-tokens-ratio must lie in (0, 1], got {swa_full_tokens_ratio}")
    per = model.per_token_layer
    if not hybrid:
        cell = float(per * (model.full_layers + model.swa_layers))
        full = int(budget // cell) // page_size * page_size
        if full <= 0:
            raise ValueError(f"--kv-budget {budget:,} bytes holds no token of {model.name} ({cell:,.0f} bytes each)")
        return PoolSizes(full, None, cell)
    cell = per * model.full_layers + swa_full_tokens_ratio * per * model.swa_layers
    full = int(budget // cell) // page_size * page_size
    swa = int(full * swa_full_tokens_ratio) // page_size * page_size
    if model.window + page_size >= swa:
        raise ValueError(
            f"the window pool ({swa} tokens) of {model.name} cannot hold one request: sliding_window_size "
            f"({model.window}) + page_size ({page_size}) must be below it; raise --kv-budget or "
            "--swa-full-tokens-ratio"
        )
    return PoolSizes(full, swa, cell)


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"32GiB"``, ``"512M"``, ``"1073741824"`` -> bytes (binary units)."""
    s = text.strip().lower().replace("_", "").replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"--kv-budget {text!r} is not a size (e.g. 32GiB, 512MiB, 1e9)") from None
    if unit not in _UNITS:
        raise ValueError(f"--kv-budget {text!r}: unknown unit {unit!r} (B, KiB, MiB, GiB, TiB)")
    out = int(value * _UNITS[unit])
    if out <= 0:
        raise ValueError(f"--kv-budget must be positive, got {text!r}")
    return out


def models_table() -> str:
    rows = ["| model | full layers | window layers | window | KV heads x head dim | bytes/token (all layers) |",
            "|---|---:|---:|---:|---|---:|"]
    for m in MODELS.values():
        rows.append(f"| `{m.name}` | {m.full_layers} | {m.swa_layers} | {m.window} | {m.kv_heads} x {m.head_dim} | "
                    f"{m.per_token_layer * (m.full_layers + m.swa_layers):,} |")
    return "\n".join(rows)
