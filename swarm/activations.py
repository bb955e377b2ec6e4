"""The activation cache: a forward's autograd graph, kept until its backward arrives.

Without it a stage server runs every micro-batch's forward twice: once to answer the forward, once
more (recomputation) when the backward comes. With it the backward starts from the graph the
forward left. The cache is bounded in bytes and in time and evicts oldest first; a backward that
finds nothing (evicted, expired, a restarted server, a backward sent to another replica) recomputes
as before, so correctness never depends on it.

Entries are keyed by the caller's peer id and its request id: one peer cannot take, or spoil,
another's entry. When room is needed, the caller holding the most bytes gives up its oldest graph
first: a peer that floods the cache with forwards whose backward never comes evicts its own graphs,
not those of the trainers it competes with (with one caller this is plain oldest-first). Only the
stage's worker thread touches the cache, so it needs no lock.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

DEFAULT_MEMORY_FRACTION = 0.25  # of the device's free memory when the server starts
DEFAULT_TTL = 120.0  # seconds an unused graph is kept: longer than a trainer waits for one call


@dataclass
class CachedForward:
    inputs: torch.Tensor  # what the graph's first operation saw (a leaf requiring grad, or token ids)
    output: torch.Tensor  # the stage's output, attached to its graph
    step: int  # the optimizer step whose parameters built the graph
    versions: tuple[int, ...]  # the parameters' in-place version counters then: any change since spoils the graph
    nbytes: int  # activation memory the graph holds (parameters excluded)
    created: float
    # The parameters the graph was built on when they are a frozen copy (StageBackend: weight stashing), not the
    # module's own: that copy outlives a step, and with it the graph. None: the module's own parameters.
    leaves: list[torch.Tensor] | None = None


class ActivationCache:
    """Forward graphs by key, at most `max_bytes` of activations, none older than `ttl` seconds."""

    def __init__(self, max_bytes: int, ttl: float = DEFAULT_TTL, clock: Callable[[], float] = time.monotonic):
        if max_bytes < 0 or ttl <= 0:
            raise ValueError(f"the activation cache needs max_bytes >= 0 and ttl > 0, got {max_bytes}, {ttl}")
        self.max_bytes, self.ttl, self.clock = max_bytes, ttl, clock
        self._entries: OrderedDict[Hashable, CachedForward] = OrderedDict()
        self._by_caller: dict[Hashable, int] = {}  # bytes each caller's graphs hold
        self.bytes_held = 0
        self.hits = 0  # backwards served from a kept graph
        self.misses = 0  # backwards that had to recompute the forward
        self.evictions = 0  # graphs dropped unused: for room, for age, or too large to keep at all

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key: Hashable, inputs: torch.Tensor, output: torch.Tensor, step: int, versions: tuple[int, ...],
            nbytes: int, leaves: list[torch.Tensor] | None = None) -> bool:
        """Keep a graph, evicting the oldest ones until it fits; False (and nothing kept) if it never can."""
        self.discard(key)
        self.expire()
        if nbytes > self.max_bytes:
            self.evictions += 1
            return False
        while self.bytes_held + nbytes > self.max_bytes:
            self._drop(self._victim())
        self._entries[key] = CachedForward(inputs, output, step, versions, nbytes, self.clock(), leaves)
        self._account(key, nbytes)
        return True

    def _victim(self) -> Hashable:
        """The oldest graph of the caller holding the most bytes."""
        biggest = max(self._by_caller, key=self._by_caller.__getitem__)
        return next(key for key in self._entries if _caller(key) == biggest)

    def _account(self, key: Hashable, nbytes: int) -> None:
        caller = _caller(key)
        held = self._by_caller.get(caller, 0) + nbytes
        if held:
            self._by_caller[caller] = held
        else:
            self._by_caller.pop(caller, None)
        self.bytes_held += nbytes

    def take(self, key: Hashable) -> CachedForward | None:
        """Remove and return the graph kept under `key`, if any (and not expired). Counts nothing."""
        self.expire()
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._account(key, -entry.nbytes)
        return entry

    def discard(self, key: Hashable) -> None:
        if key in self._entries:
            self._drop(key)

    def drop_where(self, useless: Callable[[CachedForward], bool]) -> None:
        """Drop the graphs no backward can use any more (counted as evictions)."""
        for key in [key for key, entry in self._entries.items() if useless(entry)]:
            self._drop(key)

    def expire(self) -> None:
        """Drop graphs older than the ttl (oldest first, so stop at the first young one)."""
        horizon = self.clock() - self.ttl
        while self._entries and next(iter(self._entries.values())).created <= horizon:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: Hashable) -> None:
        entry = self._entries.pop(key)
        self._account(key, -entry.nbytes)
        self.evictions += 1


def _caller(key: Hashable) -> Hashable:
    """Whose a key is: the caller's peer id of a (caller, request id) key."""
    return key[0] if isinstance(key, tuple) and key else key


class StaleGraph(RuntimeError):
    """A tensor a kept graph saved was changed in place since (e.g. the parameters stepped)."""


class SavedBytes:
    """Counts the bytes of the tensors autograd saves while a graph is built, parameters excluded.

    Use as ``with SavedBytes(params) as saved: out = module(x)``; then ``saved.nbytes``. Each
    storage counts once, however many views of it are saved. Saved-tensor hooks turn off autograd's
    own check that a saved tensor was not modified in place, so the hooks check it themselves: the
    backward of a graph whose parameters moved on raises :class:`StaleGraph` instead of giving a
    gradient of parameters nobody has any more.
    """

    def __init__(self, params: list[torch.Tensor]):
        self._skip = {p.untyped_storage().data_ptr() for p in params}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    @property
    def nbytes(self) -> int:
        return sum(self._seen.values())

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self._skip:
            self._seen[pointer] = storage.nbytes()
        # detached: a saved output kept as itself refers to its own autograd node, a cycle the garbage collector
        # does not free, so every graph evicted or never used for a backward would leak its activations.
        # A detached tensor shares the storage and the version counter that _unpack checks.
        return tensor.detach(), tensor._version

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    tensor, version = packed
    if tensor._version != version:
        raise StaleGraph(f"a tensor saved for backward changed in place (version {version} -> {tensor._version})")
    return tensor


def default_cache_bytes(device: torch.device, fraction: float = DEFAULT_MEMORY_FRACTION) -> int:
    """`fraction` of the memory free on `device` now (its RAM for a CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = _available_ram()
    return int(free * fraction)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
