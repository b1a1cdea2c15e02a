"""The global suffix tree of suffix decoding: every suffix (cut to max_depth tokens) of the outputs of past
requests, with counts, so a request can draft what earlier requests wrote after the same context (agent loops,
repeated structured outputs). Bounded: the oldest output leaves when more than max_cached_requests are held."""

from __future__ import annotations

from collections import deque

# A node is a list [count, children, seq, pos]: count = the inserted suffixes that pass through it.
# Materialized: children is a dict token -> node (seq, pos unused).
# Lazy (count 1, children None): the one suffix through it goes on with seq[pos:], up to the tree's depth. A chain
# that occurs once (most of them: the text is new) thus costs one node, not one per token; a second suffix through
# a lazy node materializes it one level at a time.
COUNT, CHILDREN, SEQ, POS = 0, 1, 2, 3


class SuffixTree:
    """Counts of the suffixes of the sequences added, each cut to max_depth tokens.

    Example, max_depth 3, add "a b a": suffixes "a b a", "b a", "a" -> root.a (count 2) -> b (1) -> a (1).
    """

    def __init__(self, max_depth: int, max_sequences: int):
        self.max_depth = max_depth
        self.max_sequences = max_sequences
        self.root: list = [0, {}, None, 0]
        self.sequences: deque[list[int]] = deque()
        self.num_nodes = 0
        """Nodes held, lazy ones included (the memory: about 200 bytes each)."""

    def add(self, tokens: list[int]) -> None:
        """Insert a finished output; evicts the oldest beyond max_sequences (0: nothing is kept)."""
        if self.max_sequences <= 0 or not tokens:
            return
        tokens = list(tokens)
        self.sequences.append(tokens)
        for start in range(len(tokens)):
            self._insert(tokens, start)
        while len(self.sequences) > self.max_sequences:
            self.evict_oldest()

    def evict_oldest(self) -> None:
        old = self.sequences.popleft()
        for start in range(len(old)):
            self._remove(old, start)

    def _insert(self, seq: list[int], start: int) -> None:
        node = self.root
        node[COUNT] += 1
        for depth in range(min(self.max_depth, len(seq) - start)):
            token = seq[start + depth]
            child = node[CHILDREN].get(token)
            if child is None:
                node[CHILDREN][token] = [1, None, seq, start + depth + 1]
                self.num_nodes += 1
                return
            if child[CHILDREN] is None:  # a second suffix through a lazy node (so only lazy nodes count 1)
                self._materialize(child, depth + 1)
            child[COUNT] += 1
            node = child

    def _materialize(self, node: list, depth: int) -> None:
        seq, pos = node[SEQ], node[POS]
        node[CHILDREN], node[SEQ] = {}, None
        if depth < self.max_depth and pos < len(seq):
            node[CHILDREN][seq[pos]] = [1, None, seq, pos + 1]  # the one suffix that was here
            self.num_nodes += 1

    def _remove(self, seq: list[int], start: int) -> None:
        node = self.root
        node[COUNT] -= 1
        for depth in range(min(self.max_depth, len(seq) - start)):
            token = seq[start + depth]
            child = node[CHILDREN][token]
            child[COUNT] -= 1
            if child[COUNT] == 0:
                self.num_nodes -= _count_nodes(child)
                del node[CHILDREN][token]
                return
            node = child

    def holds(self, token: int) -> bool:
        """Some sequence in the tree holds this token: a context ending in any other matches nothing."""
        return token in self.root[CHILDREN]

    def find(self, context: list[int], max_len: int) -> tuple[tuple[list, int] | None, int]:
        """Where the longest suffix of `context` (at most max_len tokens) ends in the tree: (node, tokens of a
        lazy node's chain already matched) and its length. A suffix of a string in the tree is in the tree too,
        so the length is found by bisection."""
        lo, hi, best = 1, min(max_len, len(context), self.max_depth), None  # lengths < lo are present
        if hi >= 1 and not self.holds(context[-1]):
            return None, 0  # not even the last token: no longer suffix either (the common case on new text)
        while lo <= hi:
            mid = (lo + hi) // 2
            at = self._walk(context[len(context) - mid:])
            if at is None:
                hi = mid - 1
            else:
                best, lo = at, mid + 1
        return best, (lo - 1 if best is not None else 0)

    def _walk(self, tokens: list[int]) -> tuple[list, int] | None:
        node, into = self.root, 0  # into: tokens consumed along a lazy node's chain
        for token in tokens:
            if node[CHILDREN] is None:
                pos = node[POS] + into
                if pos >= len(node[SEQ]) or node[SEQ][pos] != token:
                    return None
                into += 1
            else:
                node = node[CHILDREN].get(token)
                if node is None:
                    return None
        return node, into

    def speculate(self, context: list[int], k: int, max_spec_factor: float, min_token_prob: float
                  ) -> tuple[list[int], float]:
        """Drafts after the context's longest match (at most max_depth - k tokens, so k drafts fit below it):
        the most frequent child (ties: the smallest id) while the path probability, the product of child over
        parent counts, stays at least min_token_prob; the same rules as suffix_cpu.c. Returns the drafts and
        their summed probabilities."""
        at, m = self.find(context, max(self.max_depth - k, 1))
        if at is None:
            return [], 0.0
        node, into = at
        limit = min(k, int(max_spec_factor * m), self.max_depth - m)
        drafts: list[int] = []
        p, total = 1.0, 0.0
        while len(drafts) < limit:
            if node[CHILDREN] is None:  # one suffix goes on: probability 1
                pos = node[POS] + into
                if pos >= len(node[SEQ]):
                    break
                token = node[SEQ][pos]
                into += 1
            else:
                if not node[CHILDREN]:
                    break
                token, child = max(node[CHILDREN].items(), key=lambda item: (item[1][COUNT], -item[0]))
                p *= child[COUNT] / node[COUNT]
                if p < min_token_prob:
                    break
                node = child
            drafts.append(token)
            total += p
        return drafts, total


def _count_nodes(node: list) -> int:
    stack, count = [node], 0
    while stack:
        n = stack.pop()
        count += 1
        if n[CHILDREN]:
            stack.extend(n[CHILDREN].values())
    return count
