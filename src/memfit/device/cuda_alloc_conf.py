"""`PYTORCH_CUDA_ALLOC_CONF` read as torch reads it: the CUDA caching allocator's settings for its replay
(`memfit.device.cuda_caching`).

Where the rules come from (torch 2.14): the common keys, their defaults and their checks from
c10/core/AllocatorConfig.h (as installed with torch 2.14.1) and c10/core/AllocatorConfig.cpp (pytorch/pytorch of
the same period); the CUDA keys from c10/cuda/CUDAAllocatorConfig.h. The accepted and refused strings were checked
against torch 2.14.1's own parser (`torch._C._accelerator_setAllocatorSettings`, CUDA build). The string is read
from `PYTORCH_CUDA_ALLOC_CONF`, else `PYTORCH_HIP_ALLOC_CONF`, else `PYTORCH_ALLOC_CONF`: the first one set wins,
as `AcceleratorAllocatorConfig::instance()` reads them.

memfit is stricter than c10 where c10 is silently lenient: c10's `std::stoull` reads `max_split_size_mb:40.5` as
40 and `max_split_size_mb:-5` as 2^64 - 5; memfit refuses both, saying so.

Example:
    >>> conf = AllocatorConfig.parse("max_split_size_mb:128,expandable_segments:True")
    >>> conf.max_split_size == 128 << 20, conf.expandable_segments
    (True, True)
    >>> AllocatorConfig.parse("").max_split_size is None        # unlimited: every block may be split
    True
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

__all__ = ["ENV_VARS", "AllocatorConfig"]

MiB = 1 << 20
K_LARGE_BUFFER = 20 * MiB          # c10 kLargeBuffer: the default large_segment_size
K_MIN_LARGE_ALLOC = 10 * MiB       # c10 kMinLargeAlloc: large_segment_size_mb must exceed it
ROUNDUP_INTERVALS = 16             # c10 kRoundUpPowerOfTwoIntervals: 1 MiB, 2 MiB, ... 32 GiB and above

# the environment variables c10 reads, in its order: the first one set is the configuration
ENV_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")

# keys c10 accepts that do not touch the device pool the replay models (pinned host memory, locking, IPC)
_NOT_DEVICE_POOL = {
    "pinned_use_background_threads": "bool", "pinned_use_cuda_host_register": "bool",
    "pinned_use_hip_host_register": "bool", "pinned_num_register_threads": "int",
    "pinned_reserve_segment_size_mb": "int", "pinned_free_catch_all": "bool",
    "release_lock_on_cudamalloc": "bool", "release_lock_on_hipmalloc": "bool",
    "graph_capture_record_stream_reuse": "bool",
}
_DEVICE_POOL = ("large_segment_size_mb", "max_split_size_mb", "max_non_split_rounding_mb",
                "garbage_collection_threshold", "roundup_power2_divisions", "expandable_segments",
                "per_process_memory_fraction", "throw_on_cudamalloc_oom", "backend")
KEYS = frozenset(_DEVICE_POOL) | frozenset(_NOT_DEVICE_POOL)

_TOKEN = re.compile(r"[,:\[\]]|[^,:\[\]\s]+")


@dataclass(frozen=True)
class AllocatorConfig:
    """The caching allocator's settings, in bytes (c10's defaults when not given).

    Attributes:
        max_split_size: blocks this large or larger are never split, and requests below it never take one
            (`max_split_size_mb`); None: unlimited, c10's default.
        max_non_split_rounding_size: a request of at least `max_split_size` may take a cached unsplit block up
            to this much larger (`max_non_split_rounding_mb`; default: `large_segment_size`, 20 MiB).
        large_segment_size: the segment requests of 1-10 MiB are cut from, and the page of an expandable large
            segment (`large_segment_size_mb`; default 20 MiB, c10's kLargeBuffer).
        roundup_power2_divisions: per power-of-two interval of request sizes (1 MiB, 2 MiB, ..., 32 GiB and
            above; smaller requests use the first), into how many parts to round (0 or 1: 512-byte rounding).
        garbage_collection_threshold: free cached unsplit large blocks once reserved exceeds this fraction of
            the allowed memory (0: never); active only under a memory fraction, as in c10.
        expandable_segments: one segment per stream and pool that grows by mapped pages.
        per_process_memory_fraction: the part of the device's memory this process may reserve (None: not set;
            the replay treats a value as `torch.cuda.set_per_process_memory_fraction` called at the start).
        throw_on_cudamalloc_oom: c10 refuses a cudaMalloc it expects to fail (not modelled by the replay).
        backend: 'native' (the caching allocator) or 'cudaMallocAsync' (CUDA's own pool; not modelled).
        ignored: keys given that do not touch the device pool (pinned host memory, locking), with their values.
        text: the string parsed.
    """
    max_split_size: int | None = None
    max_non_split_rounding_size: int = K_LARGE_BUFFER
    large_segment_size: int = K_LARGE_BUFFER
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    per_process_memory_fraction: float | None = None
    throw_on_cudamalloc_oom: bool = False
    backend: str = "native"
    ignored: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    text: str = field(default="", compare=False)

    @classmethod
    def from_env(cls, environ=None) -> AllocatorConfig:
        """The configuration this process's environment gives torch (`ENV_VARS`, first one set)."""
        environ = os.environ if environ is None else environ
        for name in ENV_VARS:
            if name in environ:
                return cls.parse(environ[name], source=name)
        return cls()

    @classmethod
    def parse(cls, text: str, source: str = "PYTORCH_CUDA_ALLOC_CONF") -> AllocatorConfig:
        """Read `key:value,key:[a:b,>:c],...` as c10's `ConfigTokenizer` does (whitespace ignored); an unknown key,
        a malformed value or one outside c10's range raises ValueError naming it."""
        tokens = _TOKEN.findall(text)
        given: dict[str, object] = {}
        i = 0
        while i < len(tokens):
            key = tokens[i]
            if key not in KEYS:
                known = ", ".join(sorted(KEYS))
                raise ValueError(f"{source}={text!r}: unknown option {key!r}; torch 2.14's CUDA allocator knows "
                                 f"{known} (fix the name, or drop it)")
            if i + 2 >= len(tokens) or tokens[i + 1] != ":":
                raise ValueError(f"{source}={text!r}: option {key!r} needs a value, written {key}:<value>")
            if key in given:
                raise ValueError(f"{source}={text!r}: option {key!r} given twice; keep one")
            if tokens[i + 2] == "[":
                if "]" not in tokens[i + 2:]:
                    raise ValueError(f"{source}={text!r}: option {key!r} opens a list with '[' but never closes it")
                end = tokens.index("]", i + 2)
                given[key] = tokens[i + 3:end]
                i = end + 1
            else:
                given[key] = tokens[i + 2]
                i += 3
            if i < len(tokens):
                if tokens[i] != ",":
                    raise ValueError(f"{source}={text!r}: expected ',' after option {key!r}, found "
                                     f"{' '.join(tokens[i:])!r}")
                i += 1
        return cls._from_values(given, text, source)

    @classmethod
    def _from_values(cls, given: dict, text: str, source: str) -> AllocatorConfig:
        where = f"{source}={text!r}"
        out: dict[str, object] = {}
        large = K_LARGE_BUFFER
        if "large_segment_size_mb" in given:     # read first: the two below are checked against it, as in c10
            mb = _int(given["large_segment_size_mb"], "large_segment_size_mb", where)
            if mb <= K_MIN_LARGE_ALLOC // MiB:
                raise ValueError(f"{where}: large_segment_size_mb must be > {K_MIN_LARGE_ALLOC // MiB}, found {mb}")
            large = out["large_segment_size"] = mb * MiB
        out["max_non_split_rounding_size"] = large
        for key, attr in (("max_split_size_mb", "max_split_size"),
                          ("max_non_split_rounding_mb", "max_non_split_rounding_size")):
            if key in given:
                mb = _int(given[key], key, where)
                if mb < large // MiB:
                    raise ValueError(f"{where}: {key} must be >= {large // MiB} (the large segment size in MiB), "
                                     f"found {mb}")
                out[attr] = mb * MiB
        if "garbage_collection_threshold" in given:
            value = _float(given["garbage_collection_threshold"], "garbage_collection_threshold", where)
            if not 0.0 < value < 1.0:
                raise ValueError(f"{where}: garbage_collection_threshold must be in (0.0, 1.0), found {value}")
            out["garbage_collection_threshold"] = value
        if "per_process_memory_fraction" in given:
            value = _float(given["per_process_memory_fraction"], "per_process_memory_fraction", where)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{where}: per_process_memory_fraction must be in [0.0, 1.0], found {value}")
            out["per_process_memory_fraction"] = value
        for key in ("expandable_segments", "throw_on_cudamalloc_oom"):
            if key in given:
                out[key] = _bool(given[key], key, where)
        if "roundup_power2_divisions" in given:
            out["roundup_power2_divisions"] = _divisions(given["roundup_power2_divisions"], where)
        if "backend" in given:
            if given["backend"] not in ("native", "cudaMallocAsync"):
                raise ValueError(f"{where}: backend must be 'native' or 'cudaMallocAsync', found "
                                 f"{given['backend']!r}")
            out["backend"] = given["backend"]
        ignored = []
        for key, kind in _NOT_DEVICE_POOL.items():
            if key in given:
                (_bool if kind == "bool" else _int)(given[key], key, where)
                ignored.append((key, str(given[key])))
        return cls(**out, ignored=tuple(ignored), text=text)

    def divisions(self, size: int) -> int:
        """How many parts `roundup_power2_divisions` rounds a request of `size` bytes to (c10's
        `AcceleratorAllocatorConfig::roundup_power2_divisions(size)`: the interval of its highest set bit)."""
        index = max(0, size.bit_length() - 1 - 20)        # 2^20 = 1 MiB starts the first interval
        return self.roundup_power2_divisions[min(index, ROUNDUP_INTERVALS - 1)]


def _int(value, key: str, where: str) -> int:
    if not isinstance(value, str) or not value.isdigit():
        raise ValueError(f"{where}: {key} needs a whole number, found {value!r}")
    return int(value)


def _float(value, key: str, where: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {key} needs a number, found {value!r}") from None


def _bool(value, key: str, where: str) -> bool:
    if value not in ("True", "False"):
        raise ValueError(f"{where}: {key} needs True or False (capitalised, as c10 reads it), found {value!r}")
    return value == "True"


def _divisions(value, where: str) -> tuple[int, ...]:
    """c10's parseRoundUpPower2Divisions: one power of two for every interval, or a list of
    `<interval in MiB, a power of two>:<divisions>` with `>:<divisions>` for every interval after the last one named;
    the first entry also fills every interval below it."""
    def power_of_two(text: str, what: str, zero_ok: bool) -> int:
        n = _int(text, "roundup_power2_divisions", where)
        if not ((n == 0 and zero_ok) or (n > 0 and n & (n - 1) == 0)):
            raise ValueError(f"{where}: roundup_power2_divisions {what} must be a power of 2"
                             f"{' or 0' if zero_ok else ''}, found {n}")
        return n

    if isinstance(value, str):
        return (power_of_two(value, "divisions", zero_ok=False),) * ROUNDUP_INTERVALS
    out = [0] * ROUNDUP_INTERVALS
    entries = "".join(value).split(",")
    first, last = True, 0
    for entry in entries:
        parts = entry.split(":") if entry.count(":") == 1 else None
        if parts is None or not parts[1]:
            raise ValueError(f"{where}: roundup_power2_divisions entries are <MiB>:<divisions> or >:<divisions>, "
                             f"found {entry!r}")
        divisions = power_of_two(parts[1], "divisions", zero_ok=True)
        if parts[0] == ">":
            out[last + 1:] = [divisions] * (ROUNDUP_INTERVALS - last - 1)
            continue
        index = min(power_of_two(parts[0], "intervals", zero_ok=False).bit_length() - 1, ROUNDUP_INTERVALS - 1)
        if first:
            out[:index] = [divisions] * index
            first = False
        out[index] = divisions
        last = index
    return tuple(out)
