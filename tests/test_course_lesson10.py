"""Lesson 10's checks name the learner's mistake: a reduce-scatter that averages twice, sums without
dividing, uses all_reduce, keeps the wrong slice, sends every peer the whole tensor, never waits or
only works on 2 ranks; a sharded step that clips with the local norm, adds norms, scales up or
steps slices it does not own; a parameter gather that waits for every layer before the forward,
launches in backward order, never waits or launches inside the forward; a pipelined step that steps
every slice first, gathers in backward order or before the step, waits, or returns no works. The right answers pass
(all-to-all and isend/irecv alike), an untouched stub gets a first-stage hint, the third failure
of a case shows its code, and the thread ranks fail fast instead of hanging. Fast: every check
runs its ranks as threads of this process; no gloo process is spawned here (the solution notebook,
run by tests/test_course.py, measures on real gloo processes)."""

from __future__ import annotations

import textwrap
import time

import pytest

from course.grading import LEARNER_PREAMBLE, check, run_cell, stub_message


@pytest.fixture(autouse=True)
def _progress_elsewhere(tmp_path, monkeypatch):
    monkeypatch.setenv("HFSTREAM_COURSE_PROGRESS", str(tmp_path / "progress.json"))


def _results(exercise: str, source: str):
    return check(exercise, namespace=run_cell(LEARNER_PREAMBLE + textwrap.dedent(source)), quiet=True)


def _messages(exercise: str, source: str) -> list[str]:
    return [r.message for r in _results(exercise, source) if not r.passed]


# --------------------------------------------------------------------------- 10.reduce_scatter
RS_RIGHT = """
def reduce_scatter_mean(flat):
    n = dist.get_world_size()
    received = torch.empty_like(flat)
    dist.all_to_all_single(received, flat)
    return received.view(n, -1).sum(0) / n
"""

RS_P2P = """
def reduce_scatter_mean(flat):
    n, rank = dist.get_world_size(), dist.get_rank()
    size = flat.numel() // n
    chunks = flat.view(n, size)
    total = chunks[rank] / n
    works, inbox = [], []
    for peer in range(n):
        if peer != rank:
            works.append(dist.isend(chunks[peer].contiguous(), peer))
            buf = torch.empty(size, dtype=flat.dtype)
            works.append(dist.irecv(buf, peer))
            inbox.append(buf)
    for w in works:
        w.wait()
    for buf in inbox:
        total = total + buf / n
    return total
"""


@pytest.mark.parametrize("source", [RS_RIGHT, RS_P2P], ids=["all_to_all", "isend_irecv"])
def test_reduce_scatter_right_answers_pass(source):
    assert _messages("10.reduce_scatter", source) == []


@pytest.mark.parametrize("change, expected", [
    (("dist.all_to_all_single(received, flat)", "dist.all_to_all_single(received, flat / n)"), "averaged twice"),
    (("return received.view(n, -1).sum(0) / n", "return received.view(n, -1).sum(0)"), "sum over the ranks"),
    (("dist.all_to_all_single(received, flat)",
      "dist.all_to_all_single(received, flat.view(n, -1).flip(0).reshape(-1))"), "rank r must end with slice r"),
    (("return received.view(n, -1).sum(0) / n", "return received / n"), "the size of the input"),
    (("dist.all_to_all_single(received, flat)", "dist.all_to_all_single(received, flat, async_op=True)"),
     "never waited for it"),
])
def test_reduce_scatter_mistakes_are_named(change, expected):
    old, new = change
    assert old in RS_RIGHT
    messages = _messages("10.reduce_scatter", RS_RIGHT.replace(old, new))
    assert messages and expected in messages[0], messages
    assert "fix the case above first" in messages[1], messages      # the bytes case waits for the result


@pytest.mark.parametrize("call, expected", [
    ("total = flat.clone()\n    dist.all_reduce(total)", "you called dist.all_reduce"),
    ("total = torch.empty(flat.numel() // n)\n    dist.reduce_scatter_single(total, flat)",
     "dist.reduce_scatter_single is the primitive you are building"),
])
def test_using_the_ready_made_collectives_is_named(call, expected):
    messages = _messages("10.reduce_scatter", f"""
def reduce_scatter_mean(flat):
    n, rank = dist.get_world_size(), dist.get_rank()
    {call}
    size = flat.numel() // n
    return total[rank * size:(rank + 1) * size] / n
""")
    assert expected in messages[0], messages


def test_sending_every_peer_the_whole_tensor_is_named_by_its_bytes():
    whole = RS_P2P.replace("works.append(dist.isend(chunks[peer].contiguous(), peer))",
                           "works.append(dist.isend(flat, peer))").replace(
        "buf = torch.empty(size, dtype=flat.dtype)", "buf = torch.empty(n * size, dtype=flat.dtype)").replace(
        "total = total + buf / n", "total = total + buf.view(n, size)[rank] / n")
    messages = _messages("10.reduce_scatter", whole)
    assert len(messages) == 1 and "sent 1.00 x the tensor's bytes" in messages[0], messages


def test_code_that_only_works_on_two_ranks_is_named_with_the_world_size():
    two_only = RS_P2P.replace("for peer in range(n):\n        if peer != rank:",
                              "for peer in [1 - rank]:\n        if True:")
    messages = _messages("10.reduce_scatter", two_only)
    assert messages[0].startswith("4 ranks: rank 2 raised RuntimeError"), messages
    assert "peer -1" in messages[0] and "(in your code:" in messages[0], messages


def test_untouched_stub_gets_a_first_stage_hint_without_the_code():
    stub = f"def reduce_scatter_mean(flat):\n    raise NotImplementedError({stub_message('10.reduce_scatter')!r})\n"
    results = _results("10.reduce_scatter", stub)
    assert not results[0].passed and "still raises NotImplementedError" in results[0].message
    assert "the mean over all ranks of slice r" in results[0].message and "send" not in results[0].message
    assert results[0].reveal == "" and "all_to_all_single" not in results[0].message


def test_the_third_failure_of_a_case_reveals_the_code():
    twice = RS_RIGHT.replace("dist.all_to_all_single(received, flat)", "dist.all_to_all_single(received, flat / n)")
    for attempt in (1, 2, 3):
        first = _results("10.reduce_scatter", twice)[0]
        assert "averaged twice" in first.message and first.failures == attempt
        if attempt < 3:
            assert first.reveal == "", attempt
    assert "dist.all_to_all_single(received, flat)" in first.reveal and "sum(0) / N" in first.reveal
    assert all(r.passed for r in _results("10.reduce_scatter", RS_RIGHT))


# --------------------------------------------------------------------------- 10.sharded_step
STEP_RIGHT = """
def sharded_sgd_step(flat_params, grad_buffer, lr, max_norm):
    n, rank = dist.get_world_size(), dist.get_rank()
    size = flat_params.numel() // n
    mine = slice(rank * size, (rank + 1) * size)
    g = grad_buffer[mine]
    squares = g.double().pow(2).sum().reshape(1)
    dist.all_reduce(squares)
    norm = squares.sqrt().item()
    coef = min(1.0, max_norm / (norm + 1e-6))
    flat_params[mine].add_(g, alpha=-lr * coef)
    return norm
"""


def test_sharded_step_right_answer_passes():
    assert _messages("10.sharded_step", STEP_RIGHT) == []


@pytest.mark.parametrize("change, expected", [
    (("    squares = g.double().pow(2).sum().reshape(1)\n    dist.all_reduce(squares)\n    norm = squares.sqrt().item()\n",
      "    norm = float(g.norm())\n"), "its own slice, and launched no collective"),
    (("    squares = g.double().pow(2).sum().reshape(1)\n    dist.all_reduce(squares)\n    norm = squares.sqrt().item()\n",
      "    local = g.norm().reshape(1)\n    dist.all_reduce(local)\n    norm = local.item()\n"),
     "sum of the ranks' norms"),
    (("dist.all_reduce(squares)", "dist.all_reduce(squares, op=dist.ReduceOp.MAX)"),
     "the all-reduce took the maximum over the ranks"),
    (("    dist.all_reduce(squares)\n", ""), "launched no collective"),
    (("    dist.all_reduce(squares)\n    norm = squares.sqrt().item()\n",
      "    work = dist.all_reduce(squares, async_op=True)\n    norm = squares.sqrt().item()\n    work.wait()\n"),
     "read before the all-reduce finished (wait() came after the read)"),
    (("    dist.all_reduce(squares)\n", "    dist.all_reduce(squares, async_op=True)\n"),
     "read before the all-reduce finished (its work was never waited for)"),
    (("coef = min(1.0, max_norm / (norm + 1e-6))", "coef = max_norm / (norm + 1e-6)"), "scaled the gradient *up*"),
    (("flat_params[mine].add_(g, alpha=-lr * coef)", "flat_params.add_(grad_buffer, alpha=-lr * coef)"),
     "changed slices it does not own"),
])
def test_sharded_step_mistakes_are_named(change, expected):
    old, new = change
    assert old in STEP_RIGHT
    messages = _messages("10.sharded_step", STEP_RIGHT.replace(old, new))
    assert messages and any(expected in m for m in messages), messages


def test_a_read_before_wait_a_missing_collective_and_max_get_distinct_messages_and_the_step_case_names_it():
    """Three mistakes that all leave some rank with the wrong norm: each gets its own first message, and
    the skipped step case repeats which one to fix first (in what the learner did, not the code)."""
    variants = {
        "early read": STEP_RIGHT.replace("    dist.all_reduce(squares)\n    norm = squares.sqrt().item()\n",
                                         "    work = dist.all_reduce(squares, async_op=True)\n"
                                         "    norm = squares.sqrt().item()\n    work.wait()\n"),
        "no collective": STEP_RIGHT.replace("    dist.all_reduce(squares)\n", ""),
        "max": STEP_RIGHT.replace("dist.all_reduce(squares)", "dist.all_reduce(squares, op=dist.ReduceOp.MAX)"),
    }
    firsts = {}
    for name, source in variants.items():
        messages = _messages("10.sharded_step", source)
        assert len(messages) == 3, (name, messages)            # the step case and the drawn one depend on it
        first = messages[0].split(":")[1]
        assert "fix the case above first" in messages[1] and first.strip() in messages[1], (name, messages)
        assert "all_reduce(" not in messages[0] + messages[1], (name, messages)     # never the answer's code
        firsts[name] = messages[0]
    assert len({m.split(". ")[0] for m in firsts.values()}) == 3, firsts


def test_clipping_with_the_local_norm_while_returning_the_global_one_is_named():
    local_coef = STEP_RIGHT.replace("coef = min(1.0, max_norm / (norm + 1e-6))",
                                    "coef = min(1.0, max_norm / (float(g.norm()) + 1e-6))")
    messages = _messages("10.sharded_step", local_coef)
    assert "clipped with the local norm" in messages[0], messages


# --------------------------------------------------------------------------- 10.gather_hook
GATHER_HEAD = """
class ParamGather:
    def __init__(self, model):
        n, rank = dist.get_world_size(), dist.get_rank()
        self.layers = [m for m in model.modules() if list(m.parameters(recurse=False))]
        self.full, self.mine, self.views = [], [], []
        for m in self.layers:
            params = list(m.parameters(recurse=False))
            size = -(-sum(p.numel() for p in params) // n)
            full = torch.zeros(size * n, dtype=params[0].dtype)
            views, offset = [], 0
            for p in params:
                views.append(full[offset:offset + p.numel()].view(p.shape))
                offset += p.numel()
            self.full.append(full)
            self.views.append(views)
            self.mine.append(full[rank * size:(rank + 1) * size].clone())
        self.works = [None] * len(self.layers)
        self.handles = []
        for i, m in enumerate(self.layers):
            self.handles.append(m.register_forward_pre_hook(lambda module, args, i=i: self.wait_for(i)))
"""

LAUNCH = """
    def launch(self):
        for i in range(len(self.layers)):
            self.works[i] = dist.all_gather_single(self.full[i], self.mine[i], async_op=True)
"""

WAIT_FOR = """
    def wait_for(self, i):
        work, self.works[i] = self.works[i], None
        if work is None:
            return
        work.wait()
        with torch.no_grad():
            for p, v in zip(self.layers[i].parameters(recurse=False), self.views[i]):
                p.copy_(v)
"""


def test_gather_right_answer_passes():
    assert _messages("10.gather_hook", GATHER_HEAD + LAUNCH + WAIT_FOR) == []


def test_waiting_for_every_gather_before_the_forward_is_named():
    wait_all = WAIT_FOR.replace("    def wait_for(self, i):\n", "    def wait_for(self, i):\n"
                                "        if i == 0:\n            for j in range(1, len(self.layers)):\n"
                                "                self.wait_for(j)\n")
    messages = _messages("10.gather_hook", GATHER_HEAD + LAUNCH + wait_all)
    assert len(messages) == 1 and "already waited for every gather" in messages[0], messages


def test_launching_in_backward_order_is_named():
    reverse = LAUNCH.replace("for i in range(len(self.layers)):", "for i in reversed(range(len(self.layers))):")
    messages = _messages("10.gather_hook", GATHER_HEAD + reverse + WAIT_FOR)
    assert len(messages) == 1 and "in the order [3, 2, 1, 0]" in messages[0], messages


def test_copying_without_waiting_is_named():
    no_wait = WAIT_FOR.replace("        work.wait()\n", "")
    messages = _messages("10.gather_hook", GATHER_HEAD + LAUNCH + no_wait)
    assert "values that never arrived" in messages[0] and "fix the case above first" in messages[1], messages


def test_copying_before_the_wait_is_named():
    early = WAIT_FOR.replace("        work.wait()\n        with torch.no_grad():\n"
                             "            for p, v in zip(self.layers[i].parameters(recurse=False), self.views[i]):\n"
                             "                p.copy_(v)\n",
                             "        with torch.no_grad():\n"
                             "            for p, v in zip(self.layers[i].parameters(recurse=False), self.views[i]):\n"
                             "                p.copy_(v)\n        work.wait()\n")
    assert early != WAIT_FOR
    messages = _messages("10.gather_hook", GATHER_HEAD + LAUNCH + early)
    assert "you read the buffer before waiting" in messages[0] and "fix the case above first" in messages[1], messages


@pytest.mark.parametrize("size, words", [
    ("sum(p.numel() for p in params) // n", "belong to no rank and no gather ever brings them"),
    ("sum(p.numel() for p in params)", "the whole layer"),
], ids=["floor", "unsharded"])
def test_slices_that_do_not_cover_the_layer_are_named(size, words):
    head = GATHER_HEAD.replace("size = -(-sum(p.numel() for p in params) // n)", f"size = {size}")
    assert head != GATHER_HEAD
    messages = _messages("10.gather_hook", head.replace("full = torch.zeros(size * n, dtype=params[0].dtype)",
                                                        "full = torch.zeros(max(size * n, 10**4))") + LAUNCH + WAIT_FOR)
    assert len(messages) == 4 and words in messages[0], messages
    assert all("fix the case above first" in m for m in messages[1:]), messages


def test_launching_inside_the_forward_is_named():
    lazy = """
    def launch(self):
        self.pending = True

    def wait_for(self, i):
        if not getattr(self, "pending", False):
            return
        dist.all_gather_single(self.full[i], self.mine[i])
        with torch.no_grad():
            for p, v in zip(self.layers[i].parameters(recurse=False), self.views[i]):
                p.copy_(v)
        if i == len(self.layers) - 1:
            self.pending = False
"""
    messages = _messages("10.gather_hook", GATHER_HEAD + lazy)
    assert len(messages) == 1 and "launched during the forward" in messages[0], messages


# --------------------------------------------------------------------------- the thread ranks
def test_thread_ranks_that_call_different_collectives_fail_fast_instead_of_hanging():
    import torch
    import torch.distributed as dist

    from course.checks.lesson10 import in_threads

    def ranks(rank, world_size, world):
        world.timeout_s = 0.5
        if rank == 0:
            dist.all_reduce(torch.ones(1))
        return "done"

    start = time.perf_counter()
    _, errors, _ = in_threads(ranks, 2)
    assert time.perf_counter() - start < 5
    assert errors[1] is None and "every rank must make the same calls" in str(errors[0]), errors
    assert dist.all_reduce.__module__.startswith("torch"), "the real torch.distributed is back"


# --------------------------------------------------------------------------- the measured sentences
def _link(ratio, wins, sharded, overlap, limit, rounds=3):
    return {"comm_ratio": ratio, "rate_mbit": 100.0, "overlap_ms": overlap, "sharded_ms": sharded,
            "overlap_rounds": [overlap - 5, overlap, overlap + 5], "sharded_rounds": [sharded - 3, sharded, sharded + 3],
            "sharded_wins": wins, "ddp_ceiling_ms": overlap - 10, "limit_ms": limit}


@pytest.mark.parametrize("sharded, limit, words", [
    (250.0, 200.0, "50 ms above its own limit"),
    (195.0, 200.0, "at its own limit"),
    (150.0, 200.0, "below the limit computed for it"),
], ids=["above", "at", "below"])
def test_the_distance_to_the_limit_is_said_as_measured_never_negative(sharded, limit, words):
    from course.checks.lesson10 import modes_sentences

    text = " ".join(modes_sentences({"links": [_link(1.0, 3, sharded, 300.0, limit)]}))
    assert words in text and "-" not in text.split("above its own limit")[0][-12:], text


def test_the_verdict_follows_the_rounds_and_says_when_only_the_slower_link_shows_it():
    from course.checks.lesson10 import modes_sentences

    text = modes_sentences({"links": [_link(1.0, 1, 200.0, 210.0, 190.0), _link(2.0, 3, 300.0, 350.0, 290.0)]})
    assert "beat overlap in 1 of 3 rounds" in text[0] and "not a result this machine reproduces" in text[0]
    assert "in every round" in text[1] and "only on the slower link" in text[2], text


# --------------------------------------------------------------------------- 10.pipelined_step
PIPE_RIGHT = """
def pipelined_step(mine, gathered, step_slice):
    works = []
    for i in range(len(mine)):
        step_slice(i)
        works.append(dist.all_gather_single(gathered[i], mine[i], async_op=True))
    return works
"""


def test_pipelined_step_right_answer_passes():
    assert _messages("10.pipelined_step", PIPE_RIGHT) == []


@pytest.mark.parametrize("source, first, expected", [
    ("""
def pipelined_step(mine, gathered, step_slice):
    for i in range(len(mine)):
        step_slice(i)
    return [dist.all_gather_single(g, m, async_op=True) for g, m in zip(gathered, mine)]
""", 1, "you stepped all 4 slices before launching any gather"),
    ("""
def pipelined_step(mine, gathered, step_slice):
    works = []
    for i in reversed(range(len(mine))):
        step_slice(i)
        works.append(dist.all_gather_single(gathered[i], mine[i], async_op=True))
    return works[::-1]
""", 1, "the gathers went out in the order [3, 2, 1, 0]"),
    ("""
def pipelined_step(mine, gathered, step_slice):
    works = []
    for i in range(len(mine)):
        works.append(dist.all_gather_single(gathered[i], mine[i], async_op=True))
        step_slice(i)
    return works
""", 0, "brought the values from before the step"),
    ("""
def pipelined_step(mine, gathered, step_slice):
    works = []
    for i in range(len(mine)):
        step_slice(i)
        works.append(dist.all_gather_single(gathered[i], mine[i], async_op=True))
        works[-1].wait()
    return works
""", 1, "waited for a gather itself"),
    ("""
def pipelined_step(mine, gathered, step_slice):
    for i in range(len(mine)):
        step_slice(i)
        dist.all_gather_single(gathered[i], mine[i])
    return []
""", 0, "launched synchronously (async_op=False)"),
    ("""
def pipelined_step(mine, gathered, step_slice):
    for i in range(len(mine)):
        step_slice(i)
        dist.all_gather_single(gathered[i], mine[i], async_op=True)
""", 0, "returned nothing: return the 4 works in flight"),
    ("""
def pipelined_step(mine, gathered, step_slice):
    works = []
    for i in range(len(mine)):
        step_slice(i)
        if i > 0:
            works.append(dist.all_gather_single(gathered[i - 1], mine[i - 1], async_op=True))
    works.append(dist.all_gather_single(gathered[-1], mine[-1], async_op=True))
    return works
""", 1, "each gather left one step late"),
    ("""
def pipelined_step(mine, gathered, step_slice):
    works = []
    for i in range(len(mine)):
        step_slice(i)
        works.append(dist.all_gather_single(gathered[i], mine[i], async_op=True))
    return works[::-1]
""", 0, "the works came back as the gathers of buckets [3, 2, 1, 0]"),
], ids=["step_all_first", "backward_order", "gather_before_step", "waits_inside", "synchronous", "returns_nothing",
        "one_behind", "returned_reversed"])
def test_pipelined_step_mistakes_are_named(source, first, expected):
    results = _results("10.pipelined_step", source)
    failed = [r for r in results if not r.passed]
    assert failed and expected in failed[0].message, [r.message for r in results]
    assert [r.passed for r in results].index(False) == first, [r.message for r in results]
    assert all(r.reveal == "" for r in failed), "a first failure shows no code"
    if first == 0:
        assert "fix the case above first" in results[1].message
    # The first message never prints the order it wants.
    assert not any("('step', 0), ('gather', 0)" in r.message for r in failed), [r.message for r in failed]


def test_pipelined_step_third_failure_reveals_the_code():
    all_first = PIPE_RIGHT.replace("""    for i in range(len(mine)):
        step_slice(i)
        works.append(dist.all_gather_single(gathered[i], mine[i], async_op=True))""", """    for i in range(len(mine)):
        step_slice(i)
    for i in range(len(mine)):
        works.append(dist.all_gather_single(gathered[i], mine[i], async_op=True))""")
    for attempt in (1, 2, 3):
        second = _results("10.pipelined_step", all_first)[1]
        assert "before launching any gather" in second.message and second.failures == attempt
    assert "step_slice(i); works.append(dist.all_gather_single(" in second.reveal


def test_pipelining_measurement_shows_the_gathers_under_the_step_and_says_so():
    from course.checks.lesson10 import measure_pipelining, pipelining_sentences

    m = measure_pipelining(run_cell(LEARNER_PREAMBLE + textwrap.dedent(PIPE_RIGHT)), repeats=3)
    yours, unpiped = m["runs"]["yours"], m["runs"]["step, then gather"]
    assert unpiped["under_step"] == 0 and yours["under_step"] == m["buckets"] - 1, (yours, unpiped)
    text = " ".join(pipelining_sentences(m))
    assert f"{yours['last_arrival_ms']:.0f} ms after the step began" in text, text
    stub = measure_pipelining({}, repeats=1)
    assert list(stub["runs"]) == ["step, then gather"]
    assert "write exercise 10.pipelined_step first" in pipelining_sentences(stub)[0]
