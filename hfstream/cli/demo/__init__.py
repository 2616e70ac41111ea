"""What ``hfstream demo`` trains: `train_clm.py` and its accelerate configs (``accelerate/``), as package data."""
