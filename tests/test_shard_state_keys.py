"""`shard_state._agree_on_keys` on 2 gloo ranks where one rank holds no optimizer state at all.

That is the layout of a rank whose slices are all padding (a small model, many ranks), or of a
parameter only the other rank's pieces cover. Its whole-form state dict and its re-plan must
still know every key the other ranks have: per element, per parameter (with dtype and whether
it lives on the host) and constants, each from the rank that has it.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist


def agree_with_an_empty_rank(rank, world_size):
    from hfstream.gradsync.sharded.state import _agree_on_keys

    piece = torch.zeros(3)
    opt = types.SimpleNamespace(state={})
    if rank == 0:
        opt.state[piece] = {"exp_avg": torch.ones(3), "step": torch.tensor(4.0), "betas": (0.9, 0.99)}
    states = [types.SimpleNamespace(shard=types.SimpleNamespace(tensors=[piece], master=torch.zeros(3)))]
    element, param, constant = _agree_on_keys(opt, states, dist.group.WORLD, world_size)
    return element, param, constant


def test_a_rank_without_state_learns_every_key_from_the_others(run_distributed):
    for element, param, constant in run_distributed(agree_with_an_empty_rank, 2, timeout=60):
        assert element == {"exp_avg": {torch.float32: torch.float32}}
        assert param == {"step": (torch.float32, True)}
        assert constant == {"betas": (0.9, 0.99)}
