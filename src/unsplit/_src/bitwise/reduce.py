"""The canonical reduction tree: one fixed order of adds over the global chunk index.

Float addition is not associative, but a single elementwise add is exactly
rounded, so it gives the same bits on any device, in any program. Summing the
per-chunk values of a batch in ONE fixed binary tree over the *global* chunk
index therefore gives the same bits whatever the schedule, provided every
device and every microbatch owns whole subtrees of it.

The tree over ``n`` chunks is the complete binary tree over ``[0, 2**ceil(log2 n))``
with absent leaves (``>= n``) dropped: a node whose right half is absent has
the value of its left half. Any contiguous range of chunks (a device's share)
is a union of O(log n) aligned *blocks* (nodes whose leaves are all present);
:class:`Accumulator` builds exactly those blocks like a binary counter, holding
O(log n) partial sums; :func:`combine` joins blocks from anywhere into the
root, walking the same tree.

Example:
    >>> from unsplit._src.bitwise import reduce
    >>> acc = reduce.Accumulator(add=lambda a, b: f"({a}+{b})")
    >>> for g in range(3, 6):
    ...     acc.push(g, f"c{g}")
    >>> acc.blocks
    {(3, 1): 'c3', (4, 2): '(c4+c5)'}
    >>> blocks = {(0, 2): "(c0+c1)", (2, 1): "c2", **acc.blocks}
    >>> reduce.combine(blocks, 6, add=lambda a, b: f"({a}+{b})")
    '(((c0+c1)+(c2+c3))+(c4+c5))'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Block = tuple[int, int]  # (first chunk, number of chunks): an aligned power-of-two node
Add = Callable[[Any, Any], Any]


def tree_size(n: int) -> int:
    """The number of leaves of the complete tree over ``n`` chunks."""
    return 1 << max(n - 1, 0).bit_length()


def aligned_blocks(start: int, stop: int) -> list[Block]:
    """The maximal aligned blocks that tile ``[start, stop)``, in order."""
    blocks = []
    while start < stop:
        size = start & -start if start else tree_size(stop)
        while start + size > stop:
            size //= 2
        blocks.append((start, size))
        start += size
    return blocks


class Accumulator:
    """Sums consecutive chunks into aligned blocks, like a binary counter.

    Chunks must be pushed in increasing global index without gaps. After the
    last push, :attr:`blocks` maps each aligned block of the pushed range to
    its canonical sum; at most ``2 * log2(n) + 1`` partial sums are alive.
    """

    def __init__(self, add: Add):
        self._add = add
        self._stack: list[tuple[Block, Any]] = []

    def push(self, index: int, value: Any) -> None:
        if self._stack:
            (lo, size), _ = self._stack[-1]
            if lo + size != index:
                raise ValueError(
                    f"chunks must be pushed in order: expected {lo + size}, got {index}"
                )
        block, value = (index, 1), value
        while self._stack:
            (lo, size), left = self._stack[-1]
            if size != block[1] or lo % (2 * size) != 0:
                break  # the top is not this block's left sibling
            self._stack.pop()
            block, value = (lo, 2 * size), self._add(left, value)
        self._stack.append((block, value))

    @property
    def blocks(self) -> dict[Block, Any]:
        return dict(self._stack)

    @property
    def depth(self) -> int:
        return len(self._stack)


def combine(blocks: dict[Block, Any], n: int, add: Add) -> Any:
    """The canonical sum of ``n`` chunks from blocks that tile ``[0, n)``.

    Args:
        blocks: aligned blocks (from any devices or processes) and their sums;
            together they must cover every chunk exactly once.
        n: the total number of chunks.
        add: the elementwise add.
    """
    covered = sum(size for _, size in blocks)
    if covered != n:
        raise ValueError(f"blocks cover {covered} chunks, expected {n}")

    def node(lo: int, size: int) -> Any:
        if lo >= n:
            return None
        if (lo, size) in blocks:
            return blocks[(lo, size)]
        if size == 1:
            raise ValueError(f"chunk {lo} is in no block")
        left = node(lo, size // 2)
        right = node(lo + size // 2, size // 2)
        return left if right is None else add(left, right)

    return node(0, tree_size(n))
