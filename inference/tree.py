"""Draft trees as data: a list of paths of top-k ranks (Medusa's ``medusa_choices`` form).

A path ``(r1, r2, ..., rd)`` names the node reached from the root by taking the r1-th candidate at
depth 1, then the r2-th candidate below it, and so on. Node 0 is the root (the last accepted
token, always verified); the other nodes are sorted by (depth, path), so every parent comes
before its children and siblings come in rank order. Tree attention as in SpecInfer
(Miao et al., 2023, arXiv:2305.09781) and Medusa (Cai et al., 2024, arXiv:2401.10774): each
node attends to the cached prefix, its ancestors and itself.
"""

from __future__ import annotations

import functools
import os
from functools import cached_property
from pathlib import Path
from typing import Iterable, Sequence

import torch

Path_ = tuple[int, ...]


# --- pure functions on paths / parents -------------------------------------------------------

def normalize_paths(paths: Iterable[Sequence[int]], source: str = "tree") -> list[Path_]:
    """Validate the structure of ``paths`` and return them sorted by (depth, path).

    Raises ValueError for: a non-list, an empty or non-integer path, a negative rank, a duplicate,
    or a path whose prefix is missing (every proper prefix must itself be a path).
    """
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Iterable):
        raise ValueError(f"{source}: a tree is a list of paths of top-k ranks, e.g. [[0], [1], [0, 0]]; got {paths!r}")
    out: list[Path_] = []
    for p in paths:
        if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or len(p) == 0:
            raise ValueError(f"{source}: each path must be a non-empty list of ranks, got {p!r}")
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in p):
            raise ValueError(f"{source}: ranks must be integers, got path {list(p)!r}")
        if any(r < 0 for r in p):
            raise ValueError(f"{source}: ranks must be >= 0, got path {list(p)!r}")
        out.append(tuple(p))
    seen = set(out)
    if len(seen) != len(out):
        dup = next(p for p in out if out.count(p) > 1)
        raise ValueError(f"{source}: path {list(dup)} appears more than once")
    for p in out:
        if len(p) > 1 and p[:-1] not in seen:
            raise ValueError(f"{source}: path {list(p)} has no parent: its prefix {list(p[:-1])} is missing")
    return sorted(out, key=lambda p: (len(p), p))


def parent_indices(paths: Sequence[Path_]) -> list[int]:
    """Parent node of every node; ``paths`` sorted as by ``normalize_paths``. Root: -1.  [N = 1 + len(paths)]"""
    index = {p: i + 1 for i, p in enumerate(paths)}
    return [-1] + [index[p[:-1]] if len(p) > 1 else 0 for p in paths]


def node_depths(parents: Sequence[int]) -> list[int]:
    """Depth of every node (root 0); the verification position offset.  [N]"""
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return depth


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """Bool [N, N]: ``mask[i, j]`` is True when node j is node i or one of its ancestors."""
    n = len(parents)
    rows: list[list[bool]] = []
    for i in range(n):
        row = list(rows[parents[i]]) if i > 0 else [False] * n
        row[i] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool)


def children_lists(parents: Sequence[int]) -> list[list[int]]:
    """Children of every node in order of their index (= rank order for sorted paths).  [N][*]"""
    children: list[list[int]] = [[] for _ in parents]
    for i in range(1, len(parents)):
        children[parents[i]].append(i)
    return children


def retrieve_indices(parents: Sequence[int]) -> torch.Tensor:
    """Node indices of every root-to-leaf path, padded with -1.  [num_leaves, max_depth + 1]"""
    children = children_lists(parents)
    leaves = [i for i in range(len(parents)) if not children[i]]
    rows = []
    for leaf in leaves:
        rows.append(node_path(parents, leaf))
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long)


def node_path(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root (0) down to ``node``."""
    path = [node]
    while path[-1] != 0:
        path.append(parents[path[-1]])
    return path[::-1]


def paths_of(parents: Sequence[int], ranks: Sequence[int]) -> list[Path_]:
    """Inverse of ``parent_indices``: the rank path of every non-root node."""
    out: list[Path_] = [()]
    for i in range(1, len(parents)):
        out.append(out[parents[i]] + (ranks[i],))
    return out[1:]


# --- the Tree object -------------------------------------------------------------------------

class Tree:
    """A validated draft tree. Node 0 is the root; ``parents[i] < i`` for every other node.

    Build one with ``Tree.from_paths(paths)`` (static trees) or ``Tree(parents)`` (a drafter's
    per-round tree); ``load_tree`` accepts names, YAML files and lists.
    """

    def __init__(self, parents: Sequence[int], ranks: Sequence[int] | None = None, name: str | None = None):
        parents = list(parents)
        if not parents or parents[0] != -1 or any(not 0 <= parents[i] < i for i in range(1, len(parents))):
            raise ValueError(f"tree parents must start with -1 (the root) and point to earlier nodes, got {parents}")
        self.parents = parents  # [N]
        self.depths = node_depths(parents)  # [N]
        self.children = children_lists(parents)  # [N][*]
        if ranks is None:  # rank = position among siblings
            ranks = [0] * len(parents)
            for kids in self.children:
                for r, c in enumerate(kids):
                    ranks[c] = r
        self.ranks = list(ranks)  # [N], root 0
        self.name = name
        self._device_cache: dict = {}
        self._truncated: dict[int, Tree] = {}

    @classmethod
    def from_paths(cls, paths: Iterable[Sequence[int]], name: str | None = None) -> "Tree":
        paths = normalize_paths(paths, source=name or "tree")
        parents = parent_indices(paths)
        return cls(parents, ranks=[0] + [p[-1] for p in paths], name=name)

    def __len__(self) -> int:
        return len(self.parents)

    def __repr__(self) -> str:
        return f"Tree({self.name or 'custom'}: {len(self) - 1} nodes + root, depth {self.depth})"

    @property
    def size(self) -> int:
        """Nodes including the root: the verification width."""
        return len(self.parents)

    @cached_property
    def depth(self) -> int:
        return max(self.depths)

    @cached_property
    def paths(self) -> list[Path_]:
        return paths_of(self.parents, self.ranks)

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def top_k(self) -> int:
        """Candidates needed per step: the largest rank + 1."""
        return max(self.ranks) + 1

    @cached_property
    def mask(self) -> torch.Tensor:
        """Bool [N, N] ancestor-or-self mask."""
        return ancestor_mask(self.parents)

    @cached_property
    def retrieve(self) -> torch.Tensor:
        """Long [num_leaves, depth + 1] root-to-leaf node indices, padded with -1."""
        return retrieve_indices(self.parents)

    def validate(self, top_k: int | None = None, max_depth: int | None = None, source: str | None = None) -> "Tree":
        """Check the tree against a drafter: ranks below ``top_k``, depth at most ``max_depth``."""
        source = source or self.name or "tree"
        if top_k is not None and self.top_k > top_k:
            bad = next(p for p in self.paths if max(p) >= top_k)
            raise ValueError(f"{source}: path {list(bad)} uses rank {max(bad)} "
                             f"but the drafter offers only top-{top_k} candidates")
        if max_depth is not None and self.depth > max_depth:
            bad = next(p for p in self.paths if len(p) > max_depth)
            raise ValueError(f"{source}: path {list(bad)} has depth {len(bad)} but the drafter predicts at most "
                             f"{max_depth} tokens ahead (e.g. {max_depth} Medusa heads); use a shallower tree")
        return self

    def truncate(self, max_depth: int) -> "Tree":
        """The subtree of nodes at depth <= ``max_depth`` (memoised; the root always stays)."""
        if max_depth >= self.depth:
            return self
        max_depth = max(max_depth, 0)
        if max_depth not in self._truncated:
            keep = [i for i, d in enumerate(self.depths) if d <= max_depth]
            new_index = {old: new for new, old in enumerate(keep)}
            parents = [-1] + [new_index[self.parents[i]] for i in keep[1:]]
            self._truncated[max_depth] = Tree(parents, [self.ranks[i] for i in keep], name=self.name)
        return self._truncated[max_depth]

    def pending_parents(self) -> torch.Tensor | None:
        """The parents [N] still on the device, to read with the round's one read and ``settle`` the host shape
        from (a ``DeviceTree`` before its read), or None: the host shape is here."""
        return None

    def cached(self, key, build):
        """``build()`` once per key for this tree (device tensors derived from its shape)."""
        if key not in self._device_cache:
            self._device_cache[key] = build()
        return self._device_cache[key]

    def device_tensors(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(additive float mask [N, N] of 0 / finfo.min, depths [N] long) on ``device``, memoised."""
        def build():
            add = torch.full((self.size, self.size), torch.finfo(dtype).min, dtype=dtype)
            add.masked_fill_(self.mask, 0.0)
            return add.to(device), torch.tensor(self.depths, dtype=torch.long, device=device)

        return self.cached(("additive", device, dtype), build)

    def greedy_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(non-root ancestors [N, N] float: 1 where column j > 0 is row i's ancestor or itself; parents [N] long with
        the root's own 0; depths [N] float) on ``device`` for ``verify_greedy_tensors``, memoised."""
        def build():
            parents = torch.tensor([0] + self.parents[1:], dtype=torch.long)
            return (greedy_ancestors(self.mask).to(device), parents.to(device),
                    torch.tensor(self.depths, dtype=torch.float32, device=device))

        return self.cached(("greedy", device), build)

    def inner_rows(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the nodes with children [I] long, each node's parent's place among them [N] long, the root's 0) on
        ``device`` for ``verify_greedy_logits``, or None where I + 1 rows (theirs and the leaf's) save none of
        the N; memoised."""
        def build():
            inner = [i for i, kids in enumerate(self.children) if kids]
            if len(inner) + 1 >= self.size:
                return None
            place = {node: row for row, node in enumerate(inner)}
            rows = [0] + [place[p] for p in self.parents[1:]]
            return (torch.tensor(inner, dtype=torch.long, device=device),
                    torch.tensor(rows, dtype=torch.long, device=device))

        return self.cached(("inner", device), build)

    def sampling_tensors(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """(children [N, K] long on ``device``, node i's children in sibling order padded with -1; the depth) for
        ``verify_sampling_tensors``, memoised."""
        def build():
            k = max(1, max(len(kids) for kids in self.children))
            table = torch.full((self.size, k), -1, dtype=torch.long)
            for i, kids in enumerate(self.children):
                table[i, :len(kids)] = torch.tensor(kids, dtype=torch.long)
            return table.to(device), self.depth

        return self.cached(("sampling", device), build)


def greedy_ancestors(mask: torch.Tensor) -> torch.Tensor:
    """An ancestor-or-self mask [N, N] bool -> float without the root's column (``verify.greedy_leaf``'s operand)."""
    out = mask.float()
    out[:, 0] = 0.0
    return out


class DeviceTree(Tree):
    """A tree whose shape is still on the device: a dynamic tree grown with tensor ops, verified before the host
    sees it. parents: [N] long (the root's -1; parents first), depths: [N] long, ancestors: [N, N] bool
    ancestor-or-self, all on one device; N is known on the host.

    Verification needs only the device tensors (``device_tensors``, ``greedy_tensors``; ``is_chain`` is False, so
    the pass takes the tree mask, right for any shape). The host shape (``parents``, ``depths``, ``children``,
    ``ranks`` and what derives from them) comes from ``settle(parents)``, which the round's one verification read
    calls with the parents read beside the accepted leaf (``pending_parents``); a use before that reads them
    itself (one read: ``tree="auto"``'s cut reads them with the scores, processors and sampling on first use)."""

    _HOST = ("parents", "depths", "children", "ranks")

    def __init__(self, parents: torch.Tensor, depths: torch.Tensor, ancestors: torch.Tensor, max_depth: int,
                 max_children: int, name: str | None = None):
        self._tensors = (parents, depths, ancestors)  # [N], [N], [N, N]
        self._n, self.name = parents.shape[0], name
        self._bounds = (max_depth, max_children)  # known on the host: the sampling rule's loop sizes
        self._device_cache: dict = {}
        self._truncated: dict[int, Tree] = {}
        self.settled = False

    def __getattr__(self, name: str):
        if name in DeviceTree._HOST and not self.__dict__.get("settled", True):
            self.settle(self._tensors[0].tolist())  # a host use before the round's read: read the shape now
            return getattr(self, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def settle(self, parents: list[int]) -> "DeviceTree":
        """Give the host shape (the device parents, read): the fields a ``Tree`` has, the device tensors kept."""
        if not self.settled:
            cache = self._device_cache
            Tree.__init__(self, parents, name=self.name)
            self._device_cache, self.settled = cache, True
        return self

    def pending_parents(self) -> torch.Tensor | None:
        """The parents [N] to read with the round's verification read (then ``settle``), or None once settled."""
        return None if self.settled else self._tensors[0]

    @property
    def size(self) -> int:
        return self._n

    def __len__(self) -> int:
        return self._n

    @property
    def is_chain(self) -> bool:  # before the read: verified under the tree mask, which is right for a chain too
        return self.settled and all(p == i - 1 for i, p in enumerate(self.parents))

    def device_tensors(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        def build():
            _, depths, ancestors = self._tensors
            add = torch.full(ancestors.shape, torch.finfo(dtype).min, dtype=dtype, device=ancestors.device)
            return add.masked_fill_(ancestors, 0.0).to(device), depths.to(device)

        return self.cached(("additive", device, dtype), build)

    def greedy_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def build():
            parents, depths, ancestors = self._tensors
            return (greedy_ancestors(ancestors).to(device), parents.clamp(min=0).to(device),
                    depths.to(device, torch.float32))

        return self.cached(("greedy", device), build)

    def inner_rows(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        # which nodes have children is the host's to know: before the read every node's row is reduced
        return super().inner_rows(device) if self.settled else None

    def sampling_tensors(self, device: torch.device) -> tuple[torch.Tensor, int]:
        """(children [N, K] long, -1 padded, in node order; a depth bound) from the device parents, K and the depth
        the tree's bounds (``verify_sampling_tensors`` runs a level or a sibling past the real ones as a no-op)."""
        def build():
            parents = self._tensors[0]
            depth, k = self._bounds
            nodes = torch.arange(self._n, device=parents.device)
            kid = parents[None, :] == nodes[:, None]  # [N, N] node j is a child of node i
            place = torch.where(kid, kid.long().cumsum(1) - 1, k).clamp(max=k)  # [N, N] j's place among i's, else K
            table = torch.full((self._n, k + 1), -1, dtype=torch.long, device=parents.device)
            table.scatter_(1, place, nodes.expand(self._n, -1))  # column K takes the non-children: dropped
            return table[:, :k].to(device), depth

        return self.cached(("sampling", device), build)


def device_tree(parents: torch.Tensor, depths: torch.Tensor, max_depth: int, max_children: int,
                name: str | None = None) -> DeviceTree:
    """The ``DeviceTree`` of parents [N] long (the root's -1, parents before children) and depths [N] long, at most
    ``max_depth`` deep and ``max_children`` wide: its ancestor mask by ``max_depth`` hops up the parents, tensor
    ops only."""
    n, device = parents.shape[0], parents.device
    up = parents.clamp(min=0)  # the root is its own parent
    rows = torch.arange(n, device=device)
    ancestors = torch.eye(n, dtype=torch.bool, device=device)  # [N, N]
    at = rows
    for _ in range(max_depth):
        at = up[at]  # [N] each node's ancestor one hop further up
        ancestors[rows, at] = True
    return DeviceTree(parents, depths, ancestors, max_depth, max_children, name=name)


_SHAPES: dict[tuple, Tree] = {}
MAX_SHAPES = 4096  # retrieval's shapes vary with its matches: the cache is bounded (cleared when full)


def shaped_tree(parents: Sequence[int], name: str | None = None, ranks: Sequence[int] | None = None) -> Tree:
    """The ``Tree`` of ``parents`` (``ranks``: by sibling order when None), one instance per shape, ranks and name: a
    drafter that builds its tree each round (prompt lookup, suffix decoding, lookahead, a hybrid's merge, EAGLE-2's
    host growth, ``tree="auto"``'s cut) gets a shape it drafted before
    with its masks and verification tensors already built (``Tree.cached``). A tree's shape never changes after it
    is made (only its caches of derived tensors fill), and nothing writes into those tensors, so sharing is safe."""
    key = (tuple(parents), name, None if ranks is None else tuple(ranks))
    tree = _SHAPES.get(key)
    if tree is None:
        if len(_SHAPES) >= MAX_SHAPES:
            _SHAPES.clear()
        tree = _SHAPES[key] = Tree(parents, ranks=ranks, name=name)
    return tree


@functools.lru_cache(maxsize=256)
def chain(depth: int) -> Tree:
    """A chain of ``depth`` draft tokens (the classic speculative-decoding draft); one Tree per depth, so its device
    tensors are built once (a drafter whose chain's length varies by round asks for it every round)."""
    if depth < 0:
        raise ValueError(f"chain depth must be >= 0, got {depth}")
    return Tree(list(range(-1, depth)), name=f"chain-{depth}")


# --- loading ---------------------------------------------------------------------------------

def trees_dir() -> Path:
    from headway.configs import CONFIG_DIR

    return CONFIG_DIR / "trees"


def available_trees() -> list[str]:
    """Names of the shipped trees under configs/trees/."""
    return sorted(p.stem for p in trees_dir().glob("*.yaml"))


def read_tree_file(path: str | os.PathLike) -> Tree:
    """A YAML file holding either a list of paths or a mapping with a ``paths`` key."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path} is not valid YAML: {exc}") from None
    if isinstance(data, dict):
        unknown = sorted(set(data) - {"paths", "name", "description"})
        if unknown or "paths" not in data:
            raise ValueError(f"{path}: a tree file has keys 'paths' (required), 'name', 'description'; "
                             f"got {sorted(data)}")
        data = data["paths"]
    if data is None:
        raise ValueError(f"{path}: the tree file is empty; give a list of paths such as [[0], [1], [0, 0]]")
    return Tree.from_paths(data, name=path.stem)


def load_tree(spec, top_k: int | None = None, max_depth: int | None = None) -> Tree:
    """A ``Tree`` from a shipped name (``"chain-4"``, ``"tree-15"``), a YAML path, a list of paths, or a Tree.

    ``top_k`` / ``max_depth`` validate it against a drafter (ranks below top_k, depth <= max_depth).
    """
    if isinstance(spec, Tree):
        tree = spec
    elif isinstance(spec, dict):
        raise ValueError(f"dynamic tree settings {spec} are for drafters that grow their own tree (EAGLE heads, "
                         "draft models); for this drafter pass a tree name, a YAML path or a list of paths")
    elif isinstance(spec, (str, os.PathLike)):
        candidate = Path(spec)
        if candidate.suffix in (".yaml", ".yml") or candidate.is_file():
            if not candidate.is_file():
                raise FileNotFoundError(f"no tree file at {spec}")
            tree = read_tree_file(candidate)
        else:
            shipped = trees_dir() / f"{spec}.yaml"
            if not shipped.is_file():
                raise ValueError(f"unknown tree {str(spec)!r}: not a file, and not one of the shipped trees "
                                 f"{available_trees()}")
            tree = read_tree_file(shipped)
    else:
        tree = Tree.from_paths(spec)
    return tree.validate(top_k=top_k, max_depth=max_depth)
