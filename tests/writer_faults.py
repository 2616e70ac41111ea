"""Write functions the save_async tests put in place of safetensors' ``save_file``: module-level, so the
writer process (hfstream/trainer/save_writer.py) can import them by name and run them itself.

Each decides from the path it is given (the writer process started before the test and keeps no
state of it): the checkpoint's step, and the test's folder (two levels above the staging folder).
"""

from __future__ import annotations

import os

from safetensors.torch import save_file


def _run_dir(filename) -> str:   # <run dir>/.hfstream-saving/checkpoint-N/model.safetensors
    return os.path.dirname(os.path.dirname(os.path.dirname(os.fspath(filename))))


def records_pid(tensors, filename, *args, **kwargs):
    """Saves as stock, and notes the pid of the process that wrote, beside the run's folder."""
    with open(os.path.join(os.path.dirname(_run_dir(filename)), "writer-pids"), "a") as f:
        f.write(f"{os.getpid()}\n")
    return save_file(tensors, filename, *args, **kwargs)


def disk_full_at_checkpoint_4(tensors, filename, *args, **kwargs):
    if "checkpoint-4" in os.fspath(filename):
        raise OSError(28, "No space left on device")
    return save_file(tensors, filename, *args, **kwargs)


def writer_dies_at_checkpoint_4(tensors, filename, *args, **kwargs):
    """The writer process is killed in the middle of the file (half of it written); elsewhere it saves."""
    from hfstream.trainer import save_writer

    if "checkpoint-4" in os.fspath(filename) and save_writer.IN_WRITER:
        with open(filename, "wb") as f:
            f.write(b"\0" * 10)
        os._exit(9)
    return save_file(tensors, filename, *args, **kwargs)
