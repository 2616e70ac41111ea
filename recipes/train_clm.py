"""Train a small causal language model from config with `StreamTrainer`: the recipe ``hfstream demo`` runs.

The script ships inside the package, so that ``hfstream demo`` works from an install:
``hfstream/cli/demo/train_clm.py`` (its docstring lists the launch commands, `--help` every flag).
This file runs it from a clone, under the same command lines:

    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml --num_cpu_threads_per_process 1 \\
        recipes/train_clm.py --output_dir runs/demo
    python recipes/train_clm.py --output_dir runs/single --max_steps 50
"""

from hfstream.cli.demo.train_clm import leave, main

if __name__ == "__main__":
    main()
    leave()
