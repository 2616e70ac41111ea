"""A steady-state training step makes the host wait for the device nowhere in hfstream (issue 42).

On an accelerator, an op that needs a device value on the host stalls the host until the GPU
queue has drained up to it: ``.item()``/``bool()``/``float()`` (``aten._local_scalar_dense``), a
boolean mask (``nonzero`` to size the result), ``torch.equal``, ``.tolist()``, and a tensor
made from a Python list (``torch.tensor(list, device=...)``: a copy from pageable memory). The
sharded clip made about four of them every step, and the Trainer clips every step
(``max_grad_norm=1.0``). On CPU nothing waits, but the ops are the same, so the steps run on 2
gloo ranks under a dispatch mode (`HostSyncs`) that records them with the line that ran them.

What is not counted: the first steps (they plan, re-plan in arrival order, read once), torch's
optimizer's own reads (Adam reads its step counter, a CPU tensor, with ``.item()``: stock does the
same), 0-dim tensors made from Python numbers (torch's optimizers make them on the CPU), and,
through the Trainer, what transformers' own loop reads (its logging), which stock reads too.
"""

from __future__ import annotations

import collections
import os
import sys
import threading

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.multiprocess

aten = torch.ops.aten
_TORCH = os.path.dirname(torch.__file__) + os.sep
_HFSTREAM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hfstream") + os.sep
_OPTIM = os.path.join(_TORCH, "optim") + os.sep
# Ops that read a device value on the host, whatever their arguments.
_ALWAYS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.is_nonzero, aten.equal,
           aten.unique_consecutive, aten._unique, aten._unique2, aten.unique_dim, aten.repeat_interleave}
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_FRESH = {aten.lift_fresh, aten.lift_fresh_copy}


def _host_sync(func, args) -> str | None:
    """Why ``func(*args)`` would make the host wait for an accelerator (None: it would not)."""
    packet = func.overloadpacket
    if packet in _ALWAYS:
        return str(func)
    if packet in _INDEXING and any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1]):
        return f"{func} with a boolean mask (a nonzero)"
    if packet in _FRESH and args[0].dim() > 0:
        return f"{func}: a tensor made from a Python list (a copy from pageable memory to the device)"
    if packet is aten.copy_ and args[1].dim() == 0 and args[0]._base is not None:
        return f"{func} of a 0-dim tensor into a tensor's element (from the host, one value at a time)"
    return None


class HostSyncs(TorchDispatchMode):
    """Records, while ``recording``, each op that would be a host sync on an accelerator.

    Each is charged to the innermost line outside torch that ran it, except where the op is
    torch's optimizer's own (see the module's docstring). ``ran`` counts every op by the function
    that ran it, to show the mode sees the autograd hooks' and the optimizer step's ops.
    """

    def __init__(self):
        super().__init__()
        self.recording = False
        self.found: list[str] = []
        self.ran: collections.Counter = collections.Counter()
        self._thread = threading.get_ident()
        self._tolist = torch.Tensor.tolist

    def __enter__(self):
        mode = self

        def tolist(t):   # no op reaches the dispatcher on CPU: watched here
            if mode.recording and threading.get_ident() == mode._thread:
                mode._note("Tensor.tolist", sys._getframe(1))
            return mode._tolist(t)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.recording:
            why = _host_sync(func, args)
            ours, in_optimizer = _caller(sys._getframe(1))
            self.ran["torch.optim" if in_optimizer else getattr(ours, "f_code", None) and ours.f_code.co_name] += 1
            if why is not None:
                self._note(why, sys._getframe(1))
        return func(*args, **(kwargs or {}))

    def _note(self, why: str, frame) -> None:
        ours, in_optimizer = _caller(frame)
        if in_optimizer:
            return
        where = "?" if ours is None else f"{ours.f_code.co_filename}:{ours.f_lineno} ({ours.f_code.co_name})"
        self.found.append(f"{why} at {where}")


def _caller(frame):
    """The innermost frame outside torch, and whether torch's optimizer code lies between it and the op."""
    in_optimizer = False
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        in_optimizer = in_optimizer or frame.f_code.co_filename.startswith(_OPTIM)
        frame = frame.f_back
    return frame, in_optimizer


class InBfloat16(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner.to(torch.bfloat16)

    def forward(self, x):
        return self.inner(x.to(torch.bfloat16)).to(x.dtype)


class Net(nn.Module):
    """Three layers, the middle one in bfloat16: two dtypes, two groups of norms in the clip."""

    def __init__(self):
        super().__init__()
        self.a, self.mid, self.b = nn.Linear(8, 16), InBfloat16(nn.Linear(16, 16)), nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.mid(torch.tanh(self.a(x)))))


STEPS, STEADY = 6, 3   # steps 0-2 may plan and re-plan (arrival order, after step 0)


def _gradsync_steps(rank, mode: str) -> dict:
    from hfstream.gradsync import GradSync

    torch.manual_seed(0)
    model = Net()
    # Small buckets: several per dtype, parameters cut between the ranks' slices.
    sync = GradSync(model, mode=mode, bucket_mb=0.0005)
    if mode == "sharded":
        optimizer = sync.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    syncs = HostSyncs()
    norms = []
    try:
        with syncs:
            for step in range(STEPS):
                syncs.recording = step >= STEADY
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
                model(x).pow(2).mean().backward()
                sync.finish()
                norms.append(sync.clip_grad_norm_(1e-3))   # below the norm: every step clips
                optimizer.step()
                optimizer.zero_grad()
            syncs.recording = False
        cut = mode == "sharded" and any(not (pc.param_start == 0 and pc.param_end == st.params[pc.slot].numel())
                                        for st in sync.reduction.states for pc in st.shard.pieces)
    finally:
        sync.close()
    return {"found": syncs.found, "ran": syncs.ran, "buckets": len(sync.buckets), "cut": cut,
            "norms": [float(n) for n in norms]}


def _trainer_steps(rank, tmp, mode: str) -> dict:
    from transformers import TrainerCallback

    from hfstream import StreamTrainer, StreamTrainingArguments
    from tiny import lm_dataset, tiny_causal_lm, train_args

    syncs = HostSyncs()

    class Steady(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            syncs.recording = state.global_step >= STEADY

        def on_train_end(self, args, state, control, **kwargs):
            syncs.recording = False

    trainer = StreamTrainer(model=tiny_causal_lm("gpt2", seed=0), train_dataset=lm_dataset(),
                            args=train_args(StreamTrainingArguments, f"{tmp}/{mode}", max_steps=STEPS,
                                            max_grad_norm=1.0, grad_sync=mode, grad_bucket_mb="0.02",
                                            prefetch_depth=0, ddp_timeout=60),
                            callbacks=[Steady()])
    with syncs:
        trainer.train()
    # transformers' own loop reads what stock reads (the logged loss and grad_norm): only hfstream's count.
    ours = [f for f in syncs.found if _HFSTREAM in f]
    return {"found": ours, "ran": syncs.ran, "all": len(syncs.found)}


def _save_copies(rank, layers: int) -> dict:
    """The sharded optimizer's whole state gathered (a checkpoint's save): its copies of host values."""
    from hfstream.gradsync import GradSync

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
    sync = GradSync(model, mode="sharded", bucket_mb=1.0)   # one bucket, however many layers
    optimizer = sync.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))   # a CPU ``step`` per piece
    try:
        model(torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
        sync.finish()
        optimizer.step()
        syncs = HostSyncs()
        with syncs:
            syncs.recording = True
            whole = sync.optimizer_state_dict()
    finally:
        sync.close()
    # Copies from the host only: a read of a CPU tensor (Adam's step) is no sync on any device.
    copies = [f for f in syncs.found if "shard_state.py" in f and ("lift_fresh" in f or "copy_" in f)]
    return {"found": copies, "buckets": len(sync.buckets),
            "steps": sorted({float(s["step"]) for s in whole["state"].values()}), "entries": len(whole["state"])}


def _steps(rank, world_size, tmp):
    import torch.distributed as dist

    # The Trainer first: it starts the process group (accelerate), which GradSync then uses.
    out = {f"trainer-{mode}": _trainer_steps(rank, tmp, mode) for mode in ("overlap", "sharded")}
    assert dist.is_initialized() and dist.get_world_size() == 2
    out.update({mode: _gradsync_steps(rank, mode) for mode in ("overlap", "sharded")})
    out.update({f"save-{layers}": _save_copies(rank, layers) for layers in (4, 16)})
    return out


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    from hfstream.testing import run_on_ranks

    return run_on_ranks(_steps, 2, str(tmp_path_factory.mktemp("syncs")), init_process_group=False, timeout=240)


def _gradsync_ranks(steps, mode):
    return [out[mode] for out in steps]


@pytest.mark.parametrize("mode", ["overlap", "sharded"])
def test_a_steady_gradsync_step_with_the_clip_makes_no_host_sync(steps, mode):
    for rank, out in enumerate(_gradsync_ranks(steps, mode)):
        assert out["buckets"] >= 2, out["buckets"]
        assert out["found"] == [], f"rank {rank}, {mode}: " + "\n".join(out["found"])
        assert all(n > 1e-3 for n in out["norms"]), out["norms"]   # the clip scaled every step
    # The mode sees what runs inside backward (the hooks pack gradients) and inside the optimizer step.
    ran = _gradsync_ranks(steps, mode)[0]["ran"]
    assert ran["pack"] > 0, sorted(ran)
    assert ran["torch.optim"] > 0, sorted(ran)


def test_the_sharded_steps_cut_parameters_between_the_ranks(steps):
    # The clip's cut-parameter path ran: some piece holds part of a parameter.
    assert any(out["cut"] for out in _gradsync_ranks(steps, "sharded"))


@pytest.mark.parametrize("mode", ["overlap", "sharded"])
def test_a_steady_trainer_step_makes_no_host_sync_in_hfstream(steps, mode):
    for rank, out in enumerate(steps):
        got = out[f"trainer-{mode}"]
        assert got["found"] == [], f"rank {rank}, {mode}: " + "\n".join(got["found"])
        assert got["ran"]["pack"] > 0   # the steps were watched, hooks included


def test_saving_the_sharded_optimizer_copies_its_host_values_per_bucket_not_per_parameter(steps):
    # Adam's ``step`` is a 0-dim CPU tensor per piece. Gathering the whole state sends it through the
    # device: one copy of the bucket's values, not one synchronising copy per parameter (issue 42).
    for out in steps:
        small, large = out["save-4"], out["save-16"]
        assert small["buckets"] == large["buckets"] == 1
        assert (small["entries"], large["entries"]) == (8, 32) and small["steps"] == large["steps"] == [1.0]
        assert len(large["found"]) == len(small["found"]), "\n".join(large["found"])
