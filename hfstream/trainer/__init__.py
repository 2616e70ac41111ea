"""The Trainer integration: the one package of hfstream that imports transformers.

    trainer        `StreamTrainerMixin` and `StreamTrainer`: the few overrides, each named for its reason
    args           `StreamTrainingArguments`: `TrainingArguments` plus hfstream's fields
    combined_args  `stream_arguments`: the arguments combined with another subclass (TRL's ``SFTConfig``)
    field_defaults has a combined class kept its other parent's defaults?
    data_parallel  which ``grad_sync`` mode runs, on which process group
    sharded        what ``grad_sync="sharded"`` needs from the Trainer loop (callbacks, reads, saving)
    loader_state   Accelerate's end-of-loader flags, kept right while a prefetcher reads ahead
    checkpoint     refuse a damaged checkpoint before resuming from it
    save_async     ``save_async``: the stock checkpoint, written behind training
    report_file    the step report on disk, inside the checkpoint it describes
    watchdog       a rank that makes no progress is reported, then ended
    clean_exit     a finished run exits 0 (gloo's threads end before teardown)
"""
