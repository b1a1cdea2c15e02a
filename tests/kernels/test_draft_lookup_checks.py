"""The native draft lookups refuse rows and token counts outside the token buffer before any pointer reaches C."""

import numpy as np
import pytest

from pagedllm.kernels import cpu_kernels, draft_lookup

pytestmark = pytest.mark.skipif(not cpu_kernels.native_library_available(), reason="no C compiler")


@pytest.mark.parametrize("rows, num_tokens", [
    ([0, 4], [3, 3]),  # a row past the buffer's 4
    ([-1], [3]),  # a negative row
    ([1], [9]),  # more tokens than a row holds (8)
    ([1], [-1]),
    ([0, 1], [3]),  # shapes differ
])
def test_out_of_range_rows_and_counts_are_refused(rows, num_tokens):
    buf = np.zeros((4, 8), dtype=np.int64)
    rows, num_tokens = np.array(rows, dtype=np.int64), np.array(num_tokens, dtype=np.int64)
    with pytest.raises(ValueError, match="within token_ids"):
        draft_lookup.ngram_propose(buf, rows, num_tokens, 1, 2, 2)
    with pytest.raises(ValueError, match="within token_ids"):
        draft_lookup.suffix_propose(buf, rows, num_tokens, 8, 2, 1.0, 0.1)


def test_empty_and_edge_rows_are_accepted():
    buf = np.arange(32, dtype=np.int64).reshape(4, 8) % 3
    drafts, counts = draft_lookup.ngram_propose(buf, np.array([], dtype=np.int64), np.array([], dtype=np.int64),
                                                1, 2, 2)
    assert drafts.shape == (0, 2) and counts.shape == (0,)
    drafts, counts, scores, match_len = draft_lookup.suffix_propose(buf, np.array([3, 0]), np.array([8, 0]), 8, 2,
                                                                    1.0, 0.1)
    assert counts.tolist()[1] == 0 and scores.dtype == np.float64 and match_len.tolist()[1] == 0
    assert drafts[0, :counts[0]].tolist() == buf[3, 2:2 + counts[0]].tolist()  # "0 1 2 0 1 2 0 1": after "0 1"
