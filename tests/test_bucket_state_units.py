"""`gradsync/bucket_state.py`: a bucket's phases and its per-step counts.

The phase machine is what keeps a bucket from being launched twice, packed while its reduction
reads the buffer, or reused while an all-gather writes it; each allowed change is taken and
each other one refused by name. `reset()` (a new step, or after a failure) ends a reduction but
never an all-gather, whose buffer is still being written.
"""

from __future__ import annotations

import pytest
import torch

from hfstream.gradsync.bucket_state import BucketState, Phase
from hfstream.gradsync.buckets import Bucket

ALLOWED = {(Phase.COLLECTING, Phase.REDUCING), (Phase.COLLECTING, Phase.GATHERING),
           (Phase.REDUCING, Phase.COLLECTING), (Phase.GATHERING, Phase.COLLECTING)}


def bucket(n=3) -> BucketState:
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(n)]
    plan = Bucket(index=7, names=tuple(f"p{i}" for i in range(n)), numel=2 * n, nbytes=8 * n,
                  dtype=torch.float32, device=torch.device("cpu"))
    return BucketState(plan, params, torch.float32)


@pytest.mark.parametrize("start", list(Phase))
@pytest.mark.parametrize("to", list(Phase))
def test_each_phase_change_is_taken_or_refused_by_name(start, to):
    st = bucket()
    st.phase = start
    if (start, to) in ALLOWED:
        st.move(to)
        assert st.phase is to
    else:
        with pytest.raises(RuntimeError, match=f"bucket 7 cannot go from {start.name} to {to.name}"):
            st.move(to)
        assert st.phase is start


def test_a_new_bucket_is_collecting_with_every_parameter_pending():
    st = bucket(3)
    assert st.phase is Phase.COLLECTING
    assert st.pending == 3 and st.used == [False] * 3 and st.ready == [False] * 3
    assert st.buffer is None and st.views == [] and st.as_view is None and st.shard is None
    assert st.work is None and st.done is None and st.launch_time is None and st.start_event is None


def test_mark_ready_counts_each_parameter_once():
    st = bucket(3)
    assert st.mark_ready(1) is True and st.pending == 2
    assert st.mark_ready(1) is False and st.pending == 2
    assert st.mark_ready(0) and st.mark_ready(2) and st.pending == 0
    assert st.ready == [True, True, True]


@pytest.mark.parametrize("phase, after", [(Phase.COLLECTING, Phase.COLLECTING),
                                          (Phase.REDUCING, Phase.COLLECTING),
                                          (Phase.GATHERING, Phase.GATHERING)])
def test_reset_ends_a_reduction_but_not_an_all_gather(phase, after):
    st = bucket(2)
    st.mark_ready(0)
    st.used[0] = True
    st.work, st.done, st.launch_time, st.end_time = object(), object(), 1.0, 2.0
    st.phase = phase
    st.reset()
    assert st.phase is after
    assert st.pending == 2 and st.ready == [False, False] and st.used == [False, False]
    assert (st.work, st.done, st.launch_time, st.end_time) == (None, None, None, None)
