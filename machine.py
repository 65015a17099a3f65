"""This machine as the package's timings know it: what a timing depends on (`machine_key`), and the files where the
package keeps what it timed, so a later process on the same machine starts from it (`read_cache`, `write_cache`)."""

import contextlib
import json
import os
import platform
import tempfile

import torch


def cache_path(variable: str, name: str) -> str:
    """`$variable`, else `$XDG_CACHE_HOME/domino_spec/name` (`~/.cache` by default)."""
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.environ.get(variable) or os.path.join(cache_home, "domino_spec", name)


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as file:
        for line in file:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_key() -> str:
    """What every timing here depends on: the CPU, torch's version and the thread count torch runs on now."""
    return f"{cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"


def read_cache(path: str) -> dict:
    """The JSON object in `path`; empty where there is none yet or it cannot be read (the timings are redone)."""
    try:
        with open(path, encoding="utf-8") as file:
            stored = json.load(file)
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


def write_cache(path: str, stored: dict) -> None:
    """Write atomically, so a process reading at the same time sees the old file or the new one."""
    with contextlib.suppress(OSError):  # a read-only home only costs the next process the timing
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(os.path.abspath(path)), delete=False) as file:
            json.dump(stored, file, indent=1, sort_keys=True)
        os.replace(file.name, path)
