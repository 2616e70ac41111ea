"""A steady-state training step makes the host wait for the device nowhere in hfstream (issue 42).

On an accelerator, an op that needs a device value on the host stalls the host until the GPU
queue has drained up to it: ``.item()``/``bool()``/``float()`` (``aten._local_scalar_dense``), a
boolean mask (``nonzero`` to size the result), ``torch.equal``, ``.tolist()``, a tensor made
from a Python list (``torch.tensor(list, device=...)``: a copy from pageable memory), and a
host value copied into one element of a device tensor (one synchronising copy per value). The
sharded clip made about four of them every step, and the Trainer clips every step
(``max_grad_norm=1.0``). On CPU nothing waits, but the ops are the same, so the steps run on 2
gloo ranks under a dispatch mode (`HostSyncs`) that records them with the line that ran them.
The mode is the thread's, and sees backward's ops: on CPU the autograd engine runs backward and
its hooks on the calling thread (on an accelerator torch hands the mode to its device thread).

What is not counted: the first steps (they plan, re-plan in arrival order, read once), what
torch's optimizer runs (as stock runs it), work on tensors the host keeps on purpose (a host
group's flags, Adam's ``step``: see `HostSyncs`), and, through the Trainer, what transformers'
own loop reads (its logging), which stock reads too.
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
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

pytestmark = pytest.mark.multiprocess

aten = torch.ops.aten
_TORCH = os.path.dirname(torch.__file__) + os.sep
_HFSTREAM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hfstream") + os.sep
_OPTIM = os.path.join(_TORCH, "optim") + os.sep
# Ops that read a device value on the host, whatever their arguments.
_READS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.is_nonzero, aten.equal,
          aten.unique_consecutive, aten._unique, aten._unique2, aten.unique_dim, aten.repeat_interleave}
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class HostSyncs(TorchDispatchMode):
    """Records, while ``recording``, what would make the host wait for an accelerator.

    On CPU every tensor is on the host, so the mode tells the two apart by where a tensor came
    from: one made from Python data without a ``device``, or with ``device="cpu"`` named
    (``torch.tensor(flags)`` for a host group's all-reduce, Adam's ``step``), is the host's on
    purpose, and so is what is computed from host tensors only; every other tensor would be on
    the device (one made before the mode was entered too: it sees where tensors come from only
    while it is on). Recorded: a read
    of a device tensor (`_READS`, a boolean mask, ``.tolist()``), a tensor made from Python data
    with a ``device`` (a copy from pageable memory), a host value copied into one element of a
    device tensor. Each is charged to the innermost line outside torch that ran it, except where
    torch's optimizer ran it (see the module's docstring). ``ran`` counts every op by the function
    that ran it, to show the mode sees the autograd hooks' and the optimizer step's ops.
    """

    def __init__(self):
        super().__init__()
        self.recording = False
        self.found: list[str] = []
        self.ran: collections.Counter = collections.Counter()
        self._host = WeakIdKeyDictionary()   # the host's tensors (a tensor's == is elementwise: by id)
        self._thread = threading.get_ident()
        self._patched = {(torch, "tensor"): torch.tensor, (torch, "as_tensor"): torch.as_tensor,
                         (torch.Tensor, "tolist"): torch.Tensor.tolist}

    def __enter__(self):
        for (owner, name), real in self._patched.items():
            setattr(owner, name, self._made(real) if owner is torch else self._read(real))
        return super().__enter__()

    def __exit__(self, *exc):
        for (owner, name), real in self._patched.items():
            setattr(owner, name, real)
        return super().__exit__(*exc)

    def _made(self, factory):
        def made(data, *args, **kwargs):
            t = factory(data, *args, **kwargs)
            device = kwargs.get("device", args[1] if factory is torch.as_tensor and len(args) > 1 else None)
            if device is None or device == "cpu":   # named the host, not asked of a tensor (Adam's step)
                self._host[t] = True
            else:
                self._charge(f"torch.{factory.__name__}(..., device=...): a copy from pageable host memory",
                             sys._getframe(1))
            return t
        return made

    def _read(self, method):   # .tolist() reaches no op on CPU: watched here
        def read(t):
            if t not in self._host:
                self._charge(f"Tensor.{method.__name__}", sys._getframe(1))
            return method(t)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if self.recording:
            origin = _origin(sys._getframe(1))
            self.ran[origin if isinstance(origin, str) else origin.f_code.co_name] += 1
        if inputs and all(t in self._host for t in inputs):   # computed on the host: stays there
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._host[t] = True
        else:
            why = self._why(func, args)
            if why is not None:
                self._charge(why, sys._getframe(1))
        return out

    def _why(self, func, args) -> str | None:
        """Why ``func(*args)``, some of whose tensors are the device's, would make the host wait for it."""
        packet = func.overloadpacket
        if packet in _READS:
            return str(func)
        if packet in _INDEXING and any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in args[1]):
            return f"{func} with a boolean mask (a nonzero)"
        if packet is aten.copy_ and args[1] in self._host and args[1].dim() == 0 and args[0] not in self._host:
            return f"{func} of a host value into one element of a device tensor (one copy per value)"
        return None

    def _charge(self, why: str, frame) -> None:
        if not self.recording or threading.get_ident() != self._thread:
            return
        origin = _origin(frame)
        if origin is None:
            self.found.append(f"{why} at ?")
        elif not isinstance(origin, str):
            self.found.append(f"{why} at {origin.f_code.co_filename}:{origin.f_lineno} ({origin.f_code.co_name})")


def _origin(frame):
    """The innermost frame outside torch that ran an op, or "torch.optim" where torch's optimizer ran it."""
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH):
        if frame.f_code.co_filename.startswith(_OPTIM):
            return "torch.optim"
        frame = frame.f_back
    return frame


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

    def seen_in_a_gradient_hook(param):   # as GradSync's hooks run: inside backward
        param.detach().abs().sum()   # (under sharded GradSync has taken .grad already)

    model.a.weight.register_post_accumulate_grad_hook(seen_in_a_gradient_hook)
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
        in_backward = sync.stats.launched_in_backward   # buckets the hooks packed and launched
        cut = mode == "sharded" and any(not (pc.param_start == 0 and pc.param_end == st.params[pc.slot].numel())
                                        for st in sync.reduction.states for pc in st.shard.pieces)
    finally:
        sync.close()
    return {"found": syncs.found, "ran": syncs.ran, "buckets": len(sync.buckets), "cut": cut,
            "in_backward": in_backward, "norms": [float(n) for n in norms]}


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
    return {"found": ours, "ran": syncs.ran}


def _save_copies(rank, layers: int) -> dict:
    """The sharded optimizer's whole state gathered (a checkpoint's save): what of it waits for the device."""
    from hfstream.gradsync import GradSync

    syncs = HostSyncs()
    with syncs:   # from the start: the mode must see Adam's ``step`` made on the host
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)])
        sync = GradSync(model, mode="sharded", bucket_mb=1.0)   # one bucket, however many layers
        optimizer = sync.shard_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2))   # a CPU step per piece
        try:
            model(torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
            sync.finish()
            optimizer.step()
            syncs.recording = True
            whole = sync.optimizer_state_dict()
            syncs.recording = False
        finally:
            sync.close()
    return {"found": [f for f in syncs.found if "shard_state.py" in f], "buckets": len(sync.buckets),
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
    # The mode sees what runs inside backward (the gradient hooks pack and launch buckets) and inside
    # the optimizer step.
    out = _gradsync_ranks(steps, mode)[0]
    ran = out["ran"]
    assert ran["seen_in_a_gradient_hook"] > 0 and out["in_backward"] > 0 and ran["pack"] > 0, sorted(ran)
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


def test_saving_the_sharded_optimizer_waits_for_the_device_per_bucket_not_per_parameter(steps):
    # Adam's ``step`` is a 0-dim CPU tensor per piece. Gathering the whole state sends it through the
    # device: one copy of the bucket's values, not one synchronising copy per parameter (issue 42).
    for out in steps:
        small, large = out["save-4"], out["save-16"]
        assert small["buckets"] == large["buckets"] == 1
        assert (small["entries"], large["entries"]) == (8, 32) and small["steps"] == large["steps"] == [1.0]
        assert len(large["found"]) == len(small["found"]), "\n".join(large["found"])
