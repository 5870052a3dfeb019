"""Reading a feature cache (``headway.train.features`` writes it) lazily.

Reading is lazy (``load_cached_features``): shards are memory-mapped with ``safe_open`` and only
the rows (and columns, for a layer subset) of the example asked for are read. Under several
training processes each rank therefore reads from disk only the feature rows of its own share
(the examples it indexes); what every rank holds in RAM is the token ids, loss masks and offsets
of all shards (about 5 bytes per token), which length-based choices and the draft vocabulary need.
"""

from __future__ import annotations

import bisect
import collections
import json
import operator
from collections.abc import Iterator, ItemsView, KeysView, ValuesView
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from headway.train.features import _DTYPE_NAMES, _DTYPES, _RECREATE, CACHE_FORMAT, INDEX_NAME, _fingerprint_diff
from headway.heads.values import first_line

_OPEN_SHARDS = 32  # memory-mapped shard handles kept open per cache


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


class CachedExample(dict):
    """One cached sequence: ``input_ids`` and ``loss_mask`` (lists) are held; ``features`` and
    ``argmax`` are read from the memory-mapped shard on first access (then kept)."""

    __slots__ = ("_lazy", "_loader")

    def __init__(self, eager: dict, lazy: tuple[str, ...], loader):
        super().__init__(eager)
        self._lazy = lazy
        self._loader = loader

    def __missing__(self, key):
        if key not in self._lazy:
            raise KeyError(key)
        value = self._loader(key)
        dict.__setitem__(self, key, value)
        return value

    def _keys(self) -> list:
        return list(dict.keys(self)) + [k for k in self._lazy if not dict.__contains__(self, k)]

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or key in self._lazy

    def __iter__(self):
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def keys(self):
        return KeysView(self)

    def items(self):
        return ItemsView(self)

    def values(self):
        return ValuesView(self)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def copy(self) -> dict:
        return {k: self[k] for k in self}

    def __eq__(self, other):
        return dict(self.items()) == other if isinstance(other, dict) else NotImplemented

    __hash__ = None

    def __reduce__(self):
        return dict, (self.copy(),)

    def __repr__(self) -> str:
        shown = ", ".join(f"{k!r}: {dict.__getitem__(self, k)!r}" if dict.__contains__(self, k) else f"{k!r}: <lazy>"
                          for k in self._keys())
        return f"CachedExample({{{shown}}})"


class _ShardStore:
    """The shards of one cache: token ids, masks and offsets in RAM, features memory-mapped."""

    def __init__(self, out_dir: Path, index: dict):
        self.out_dir = out_dir
        self.index = index
        self.names: list[str] = list(index["shards"])
        self.layers: list[int] = list(index["layers"])
        self.hidden_size: int = int(index["hidden_size"])
        self.dtype: torch.dtype = _DTYPES[index["dtype"]]
        self.has_argmax: bool = bool(index["with_argmax"])
        self.ids: list[torch.Tensor] = []
        self.masks: list[torch.Tensor] = []
        self.offsets: list[list[int]] = []
        self.starts: list[int] = [0]  # first global sequence index of each shard, then the total
        self._handles: collections.OrderedDict = collections.OrderedDict()
        width = len(self.layers) * self.hidden_size
        for name in self.names:
            path = out_dir / name
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    keys = set(f.keys())
                    need = {"features", "input_ids", "loss_mask", "offsets"} | ({"argmax"} if self.has_argmax else set())
                    if need - keys:
                        raise ValueError(f"feature shard {path} lacks {sorted(need - keys)}; delete it and rerun "
                                         "scripts/cache_features.py")
                    ids, mask, offsets = f.get_tensor("input_ids"), f.get_tensor("loss_mask"), f.get_tensor("offsets")
                    shape = f.get_slice("features").get_shape()  # the header only, no feature data
            except (SafetensorError, OSError) as exc:
                raise ValueError(f"feature shard {path} is missing or corrupt ({first_line(exc)}); "
                                 "rerun scripts/cache_features.py to rewrite it") from None
            if list(shape) != [ids.numel(), width] or int(offsets[-1]) != ids.numel():
                raise ValueError(f"feature shard {path} does not fit its index (features {list(shape)}, "
                                 f"{ids.numel()} tokens, width {width} expected); delete it and rerun "
                                 "scripts/cache_features.py")
            self.ids.append(ids.to(torch.int32))
            self.masks.append(mask.to(torch.uint8))
            self.offsets.append(offsets.tolist())
            self.starts.append(self.starts[-1] + len(offsets) - 1)

    def __len__(self) -> int:
        return self.starts[-1]

    def __getstate__(self):
        return {**self.__dict__, "_handles": collections.OrderedDict()}  # handles are reopened

    def handle(self, s: int):
        h = self._handles.pop(s, None)
        if h is None:
            h = safe_open(str(self.out_dir / self.names[s]), framework="pt", device="cpu")
            while len(self._handles) >= _OPEN_SHARDS:
                self._handles.popitem(last=False)
        self._handles[s] = h
        return h

    def locate(self, g: int) -> tuple[int, int, int]:
        """Global sequence index -> (shard, first row, end row)."""
        s = bisect.bisect_right(self.starts, g) - 1
        j = g - self.starts[s]
        return s, self.offsets[s][j], self.offsets[s][j + 1]

    def tokens(self, g: int) -> tuple[list[int], list[int]]:
        s, a, b = self.locate(g)
        return self.ids[s][a:b].tolist(), self.masks[s][a:b].tolist()

    def length(self, g: int) -> int:
        s, a, b = self.locate(g)
        return b - a

    def read(self, g: int, key: str, columns: list[tuple[int, int]] | None) -> torch.Tensor:
        s, a, b = self.locate(g)
        view = self.handle(s).get_slice(key)
        if key == "argmax":
            return view[a:b].long()
        if columns is None:
            return view[a:b]
        parts = [view[a:b, c0:c1] for c0, c1 in columns]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def _column_runs(cached: list[int], chosen: list[int], hidden: int) -> list[tuple[int, int]] | None:
    """Feature columns of ``chosen`` layers in a row of ``cached`` layers, merged into runs;
    None when the selection is the whole row."""
    if chosen == cached:
        return None
    runs: list[list[int]] = []
    for layer in chosen:
        c0 = cached.index(layer) * hidden
        if runs and runs[-1][1] == c0:
            runs[-1][1] = c0 + hidden
        else:
            runs.append([c0, c0 + hidden])
    return [(a, b) for a, b in runs]


class CachedFeatures:
    """A lazy, read-only sequence of cached examples (see ``load_cached_features``).

    ``len``, ``cache[i]`` (a ``CachedExample``), ``cache[a:b:c]`` (another lazy view) and iteration.
    Iterating and reading ``input_ids`` / ``loss_mask`` never touches the feature rows."""

    def __init__(self, store: _ShardStore, indices: range | list[int] | None = None, layers: list[int] | None = None):
        self._store = store
        self._indices = range(len(store)) if indices is None else indices
        self.layers: list[int] = list(store.layers if layers is None else layers)
        self._columns = _column_runs(store.layers, self.layers, store.hidden_size)

    # --- what the cache holds
    @property
    def cached_layers(self) -> list[int]:
        """Every layer the cache stores (``layers`` is the selection this view returns)."""
        return list(self._store.layers)

    @property
    def hidden_size(self) -> int:
        return self._store.hidden_size

    @property
    def feature_width(self) -> int:
        return len(self.layers) * self._store.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self._store.dtype

    @property
    def has_argmax(self) -> bool:
        return self._store.has_argmax

    @property
    def index(self) -> dict:
        """The cache's index.json (meta, fingerprint, layers, dtype, num_tokens, bytes_per_token, ...)."""
        return self._store.index

    @property
    def bytes_per_token(self) -> int:
        """Feature bytes per token as stored (all cached layers)."""
        return int(self._store.index["bytes_per_token"])

    # --- sequence protocol
    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return CachedFeatures(self._store, self._indices[i], self.layers)
        g = self._indices[operator.index(i)]
        return self._example(g)

    def __iter__(self) -> Iterator[CachedExample]:
        for g in self._indices:
            yield self._example(g)

    def __repr__(self) -> str:
        return (f"CachedFeatures({len(self)} sequences, layers {self.layers} of {self.cached_layers}, "
                f"{_DTYPE_NAMES[self.dtype]}, {self._store.out_dir})")

    def _example(self, g: int) -> CachedExample:
        ids, mask = self._store.tokens(g)
        lazy = ("features", "argmax") if self._store.has_argmax else ("features",)
        columns = self._columns
        return CachedExample({"input_ids": ids, "loss_mask": mask}, lazy,
                             lambda key: self._store.read(g, key, None if key == "argmax" else columns))

    # --- helpers
    def with_layers(self, layers) -> "CachedFeatures":
        """The same sequences with another selection of the cached layers."""
        return CachedFeatures(self._store, self._indices, _select_layers(self._store, layers))

    def token_lists(self) -> Iterator[dict]:
        """``{"input_ids", "loss_mask"}`` per sequence (plain lists, no features), e.g. for
        ``frequent_tokens``."""
        for g in self._indices:
            ids, mask = self._store.tokens(g)
            yield {"input_ids": ids, "loss_mask": mask}

    def lengths(self) -> list[int]:
        return [self._store.length(g) for g in self._indices]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths())


def _select_layers(store: _ShardStore, layers) -> list[int]:
    layers = [int(i) for i in layers]
    missing = [i for i in layers if i not in store.layers]
    if missing or not layers or len(set(layers)) != len(layers):
        raise ValueError(f"feature cache {store.out_dir} holds layers {store.layers}, this run needs {layers}"
                         f"{f' (missing {missing})' if missing else ''}; {_RECREATE} --layers "
                         f"{','.join(map(str, sorted(set(store.layers) | set(layers))))}")
    return layers


def read_cache_index(out_dir: str | Path, expect_meta: dict | None = None) -> dict:
    """A complete feature cache's index, without opening a shard (a run checks its cache with this
    before it loads the target). ``expect_meta``: keys that must equal the cache's meta. A missing,
    old, incomplete or foreign cache is a one-line error that says what to do."""
    out_dir = Path(out_dir)
    index_path = out_dir / INDEX_NAME
    if not index_path.is_file():
        raise FileNotFoundError(f"{out_dir} is not a feature cache (no {INDEX_NAME}); "
                                "create it with scripts/cache_features.py")
    try:
        index = json.loads(index_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{index_path} is not valid JSON ({exc}); {_RECREATE}") from None
    if not isinstance(index, dict):
        raise ValueError(f"{index_path} is not a feature cache's index; {_RECREATE}")
    if index.get("format") != CACHE_FORMAT:
        raise ValueError(f"feature cache {out_dir} was written by an older headway (format {index.get('format', 1)}, "
                         f"this one reads {CACHE_FORMAT}); {_RECREATE}")
    if not index.get("complete"):
        raise ValueError(f"feature cache {out_dir} is incomplete; rerun scripts/cache_features.py to finish it")
    if expect_meta is not None:
        for key, value in expect_meta.items():
            if index["meta"].get(key) != value:
                raise ValueError(f"feature cache {out_dir} was made with {key}={index['meta'].get(key)!r}, "
                                 f"this run needs {value!r}; recreate the cache with scripts/cache_features.py")
    return index


def load_cached_features(out_dir: str | Path, expect_meta: dict | None = None, expect_fingerprint: dict | None = None,
                         layers: list[int] | None = None) -> CachedFeatures:
    """Open a complete feature cache lazily.

    Items are dicts {input_ids: list, loss_mask: list, features: Tensor [T, len(layers) * H] in the
    stored dtype, argmax: Tensor [T] long (when stored)}. ``expect_meta``: keys that must equal the
    cache's meta (model name, data config). ``expect_fingerprint``: ``feature_fingerprint`` of
    the run's target and tokenizer; its layers must be among the cached ones. ``layers``: the
    cached layers to return (a column slice), default the fingerprint's layers, else all of them.
    Mismatches raise a one-line ValueError that says what differs."""
    out_dir = Path(out_dir)
    index = read_cache_index(out_dir, expect_meta)
    if expect_fingerprint is not None:
        diff = _fingerprint_diff(index.get("fingerprint") or {}, expect_fingerprint)
        if diff:
            raise ValueError(f"feature cache {out_dir} was made for another target or tokenizer: {diff}; {_RECREATE}")
    store = _ShardStore(out_dir, index)
    if index.get("num_sequences") is not None and len(store) != index["num_sequences"]:
        raise ValueError(f"feature cache {out_dir}: its shards hold {len(store)} sequences but its index lists "
                         f"{index['num_sequences']} (a shard is missing from the index or was replaced); {_RECREATE}")
    if layers is None and expect_fingerprint is not None and expect_fingerprint.get("layers") is not None:
        layers = expect_fingerprint["layers"]
    return CachedFeatures(store, layers=None if layers is None else _select_layers(store, layers))
