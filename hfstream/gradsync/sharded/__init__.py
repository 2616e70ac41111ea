"""The sharded engine, ``GradSync(mode="sharded")``: reduce-scatter in backward, step a slice, all-gather after.

    reduction    `ShardedReduction`, the strategy: a bucket from its hooks to the next forward's wait
    layout       where each rank's slice of a bucket lies (`Piece`, `BucketShard`), computed once
    collectives  the two halves of an all-reduce, each with the primitive cheaper on the backend
    optim        the sharded optimizer (each rank steps its pieces) and global-norm clipping
    state        the optimizer's state across layouts: a re-plan, a checkpoint, another world size
    param_waits  where the next forward waits for each bucket's all-gather
"""
