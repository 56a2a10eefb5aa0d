"""Load SGLang 0.5.23's compiled Rust radix-tree core (``rust_tree_core/mem_cache*.so``) on CPU.

    from tools.sglang_rust_shim import load_rust_tree_core
    mod, how = load_rust_tree_core(fetch=True)     # (module, where from) or (None, why not)
    core = mod.RustUnifiedTreeCoreBinding(mod.TreeCoreInitParamsBinding(page_size=16, device="cpu"), [0])

SGLang's wheel ships the extension prebuilt; it needs only torch (imported
first, so that libtorch is resident).  The wheel is looked for, in order: the
``wheel`` argument, ``$KVCORE_SGLANG_WHEEL``, the cache folder
(``$KVCORE_BENCH_CACHE`` or ``~/.cache/kvcore-bench``); with ``fetch=True``
a missing one is fetched with ``pip download --no-deps sglang==0.5.23`` into
the cache folder.  Only the extension is taken out of the wheel (into
``<cache>/sglang-<version>/``); nothing of SGLang is copied into this
repository.  Any failure (no wheel, no network, a wheel for another Python or
platform) comes back as ``(None, reason)`` so that a benchmark can skip the peer.
"""

from __future__ import annotations

import glob
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import sysconfig
import zipfile
from types import ModuleType

__all__ = ["RUST_CORE_VERSION", "cache_dir", "load_rust_tree_core"]

RUST_CORE_VERSION = "0.5.23"
_MEMBER_DIR = "sglang/srt/mem_cache/rust_tree_core/"


def cache_dir() -> str:
    return os.environ.get("KVCORE_BENCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvcore-bench")


def _find_wheel(folder: str, version: str) -> str | None:
    found = sorted(glob.glob(os.path.join(folder, f"sglang-{version}-*.whl")))
    return found[-1] if found else None


def _fetch_wheel(folder: str, version: str) -> tuple[str | None, str]:
    os.makedirs(folder, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
           "-d", folder, f"sglang=={version}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"pip download failed: {type(exc).__name__}: {exc}"
    wheel = _find_wheel(folder, version)
    if wheel is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        return None, f"pip download sglang=={version} gave no wheel ({tail[0]})"
    return wheel, "fetched"


def _extract(wheel: str, folder: str) -> tuple[str | None, str]:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith(_MEMBER_DIR + "mem_cache") and m.endswith(".so")]
            if not members:
                return None, f"{os.path.basename(wheel)} holds no {_MEMBER_DIR}mem_cache*.so"
            fitting = [m for m in members if m.endswith(suffix)]
            if not fitting:
                return None, (f"{os.path.basename(wheel)}'s extension ({os.path.basename(members[0])}) "
                              f"does not fit this Python ({suffix})")
            target = os.path.join(folder, os.path.basename(fitting[0]))
            if not os.path.exists(target):
                os.makedirs(folder, exist_ok=True)
                tmp = target + f".part{os.getpid()}"
                with zf.open(fitting[0]) as src, open(tmp, "wb") as dst:
                    dst.write(src.read())
                os.replace(tmp, target)
            return target, "ok"
    except (OSError, zipfile.BadZipFile) as exc:
        return None, f"cannot read {wheel}: {exc}"


def load_rust_tree_core(*, wheel: str | None = None, fetch: bool = False,
                        version: str = RUST_CORE_VERSION) -> tuple[ModuleType | None, str]:
    """``(the extension module, where it came from)`` or ``(None, why it could not be loaded)``."""
    folder = cache_dir()
    target = os.path.join(folder, f"sglang-{version}")
    wheel = wheel or os.environ.get("KVCORE_SGLANG_WHEEL") or _find_wheel(folder, version)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    extracted = os.path.join(target, "mem_cache" + suffix)
    if wheel is None and os.path.exists(extracted):
        so, how, wheel = extracted, "extracted earlier", f"sglang-{version}"
    else:
        how = "wheel"
        if wheel is None or not os.path.exists(wheel):
            if not fetch:
                return None, (f"no sglang-{version} wheel in {folder} (pass --rust-core fetch to pip download "
                              "it, or --rust-core PATH.whl)")
            wheel, how = _fetch_wheel(folder, version)
            if wheel is None:
                return None, how
        found, why = _extract(wheel, target)
        if found is None:
            return None, why
        so = found
    try:
        import torch  # noqa: F401 - libtorch must be resident before the extension is opened

        loader = importlib.machinery.ExtensionFileLoader("mem_cache", so)
        spec = importlib.util.spec_from_file_location("mem_cache", so, loader=loader)
        assert spec is not None
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        mod.RustUnifiedTreeCoreBinding  # noqa: B018 - the class the benchmark drives
    except Exception as exc:  # noqa: BLE001 - any load failure means: skip this peer
        return None, f"cannot load {so}: {type(exc).__name__}: {exc}"
    return mod, f"SGLang {version} Rust tree core ({how}: {os.path.basename(wheel)})"
