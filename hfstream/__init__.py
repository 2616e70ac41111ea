"""hfstream: hide data movement and gradient communication behind compute in HF training."""
__version__ = "0.1.0"
