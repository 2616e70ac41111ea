"""What the tests, the benchmarks and the course run hfstream with: ranks as processes, a slow link.

    ranks  `run_on_ranks`: a function on N gloo processes on this machine, a hang turned into a
           failure; `launch_nodes` and its kin for multi-node launches on one machine
    link   `SimulatedLink`: a slow link on one CPU machine, without root (imported by name:
           ``from hfstream.testing.link import SimulatedLink``)
"""

from .ranks import (NodeRun, RankFailure, free_port, launch_nodes, processes_mentioning, rank_env, run_on_ranks,
                    stop_nodes, wait_nodes)

__all__ = ["NodeRun", "RankFailure", "free_port", "launch_nodes", "processes_mentioning", "rank_env",
           "run_on_ranks", "stop_nodes", "wait_nodes"]
